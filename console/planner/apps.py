from django.apps import AppConfig


class PlannerConfig(AppConfig):
    """The capacity planner: the PrfaaS throughput model and KV-size calculator over the API.
    The model itself (``model.py`` and friends) is pure Python and never imports Django."""

    name = "console.planner"
    label = "planner"
    verbose_name = "Capacity planner"
