from django.apps import AppConfig


class SchedulesConfig(AppConfig):
    """Tidal schedules (hourly prices, capacity windows, the hour's plan applied by beat) and
    long-timescale rebalancing proposals for the local prefill / decode split."""

    name = "console.schedules"
    label = "schedules"
    verbose_name = "Schedules and rebalancing"

    def ready(self) -> None:
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register

        # Next to the Planner (50).
        nav_register(NavItem("Tidal", "tidal-page-list", Role.VIEWER, order=55))
