from django.apps import AppConfig


class DrillsConfig(AppConfig):
    """Drills: link-cut and remote-restart exercises of the fallback path, and their reports."""

    name = "console.drills"
    label = "drills"
    verbose_name = "Drills"

    def ready(self) -> None:
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register

        # After Runs (40), before Planner (50).
        nav_register(NavItem("Drills", "drills-page", Role.VIEWER, order=45))
