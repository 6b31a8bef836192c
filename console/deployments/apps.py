from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    """Deployments, their pools and the numbered config snapshots data-plane components poll."""

    name = "console.deployments"
    label = "deployments"
    verbose_name = "Deployments"
