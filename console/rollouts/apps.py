from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    """Rollout plans: the canary steps and the gates each step must pass."""

    name = "console.rollouts"
    label = "rollouts"
    verbose_name = "Rollout plans"
