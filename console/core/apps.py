from django.apps import AppConfig


class CoreConfig(AppConfig):
    """Cross-cutting pieces: roles, the audit log, API conventions."""

    name = "console.core"
    label = "core"
    verbose_name = "Core"
