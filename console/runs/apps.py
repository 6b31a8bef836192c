from django.apps import AppConfig


class RunsConfig(AppConfig):
    """Workflow runs and their steps: the record of truth for everything the orchestrator does."""

    name = "console.runs"
    label = "runs"
    verbose_name = "Runs"
