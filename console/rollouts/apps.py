from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    """Rollout plans: the canary steps and the gates each step must pass."""

    name = "console.rollouts"
    label = "rollouts"
    verbose_name = "Rollout plans"

    def ready(self) -> None:
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register

        # Next to Canaries (42), which run these plans.
        nav_register(NavItem("Rollouts", "rollout-plans-page", Role.VIEWER, order=43))
