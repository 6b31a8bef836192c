from django.apps import AppConfig


class AlertsConfig(AppConfig):
    """Alert rules over telemetry series, the alerts they raise (firing / resolved, with
    history) and the channels (webhooks, e-mail) that hear about them."""

    name = "console.alerts"
    label = "alerts"
    verbose_name = "Alerts"
