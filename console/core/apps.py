from django.apps import AppConfig


class CoreConfig(AppConfig):
    """Cross-cutting pieces: roles, the audit log, API conventions, the page layout."""

    name = "console.core"
    label = "core"
    verbose_name = "Core"

    def ready(self) -> None:
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register

        # The built-in pages. A later feature registers its own entry from its AppConfig.
        for order, (label, url_name, role) in enumerate(
            [
                ("Overview", "overview", Role.VIEWER),
                ("Sites", "sites-page", Role.VIEWER),
                ("Models", "models-page", Role.VIEWER),
                ("Deployments", "deployments-page", Role.VIEWER),
                ("Runs", "runs-page", Role.VIEWER),
                ("Planner", "planner", Role.VIEWER),
                ("Security", "security", Role.VIEWER),
                ("Audit log", "audit-log", Role.VIEWER),
            ]
        ):
            nav_register(NavItem(label, url_name, role, order=order * 10))
