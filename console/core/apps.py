from django.apps import AppConfig


class CoreConfig(AppConfig):
    """Cross-cutting pieces: roles, the audit log, API conventions, the page layout."""

    name = "console.core"
    label = "core"
    verbose_name = "Core"

    def ready(self) -> None:
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register

        # The built-in pages; a later feature registers its own entry from its AppConfig, its
        # order between these (alerts 16, traces 17, canaries 42, rollouts 43, drills 45, tidal
        # 55, gateway keys 85).
        for order, label, url_name in [
            (0, "Overview", "overview"),
            (10, "Sites", "sites-page"),
            (12, "Nodes", "nodes-page"),
            (14, "Links", "links-page"),
            (20, "Models", "models-page"),
            (30, "Deployments", "deployments-page"),
            (40, "Runs", "runs-page"),
            (50, "Planner", "planner"),
            (60, "Security", "security"),
            (70, "Audit log", "audit-log"),
        ]:
            nav_register(NavItem(label, url_name, Role.VIEWER, order=order))
