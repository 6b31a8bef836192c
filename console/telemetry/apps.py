from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    """Time series the console keeps: heartbeats, probes, gateway and engine scrapes. Charts,
    canary gates, drill reports and alerts read them."""

    name = "console.telemetry"
    label = "telemetry"
    verbose_name = "Telemetry"

    def ready(self) -> None:
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register

        nav_register(NavItem("Traces", "traces-page", Role.VIEWER, order=17))
