from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    """Deployments, their pools and the numbered config snapshots data-plane components poll."""

    name = "console.deployments"
    label = "deployments"
    verbose_name = "Deployments"

    def ready(self) -> None:
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register

        # After Runs (40), before Drills (45) and Planner (50).
        nav_register(NavItem("Canaries", "canaries-page", Role.VIEWER, order=42))
