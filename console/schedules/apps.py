from django.apps import AppConfig


class SchedulesConfig(AppConfig):
    """Tidal schedules (hourly prices, capacity windows, the hour's plan applied by beat) and
    long-timescale rebalancing proposals for the local prefill / decode split."""

    name = "console.schedules"
    label = "schedules"
    verbose_name = "Schedules and rebalancing"
