from django.apps import AppConfig


class AlertsConfig(AppConfig):
    """Alert rules over telemetry series, the alerts they raise (firing / resolved, with
    history) and the channels (webhooks, e-mail) that hear about them."""

    name = "console.alerts"
    label = "alerts"
    verbose_name = "Alerts"

    def ready(self) -> None:
        from console.alerts.panels import firing_alerts_context
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register
        from console.core.panels import OverviewPanel, overview_panel_register

        nav_register(NavItem("Alerts", "alerts-page", Role.VIEWER, order=16))
        overview_panel_register(
            OverviewPanel(
                key="alerts",
                title="Alerts",
                template="alerts/overview_panel.html",
                context=firing_alerts_context,
                order=10,
            )
        )
