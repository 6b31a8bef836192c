from django.apps import AppConfig


class DrillsConfig(AppConfig):
    """Drills: link-cut and remote-restart exercises of the fallback path, and their reports."""

    name = "console.drills"
    label = "drills"
    verbose_name = "Drills"
