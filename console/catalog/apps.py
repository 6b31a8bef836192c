from django.apps import AppConfig


class CatalogConfig(AppConfig):
    """Models: architecture (for KV size), weights identity, engine settings."""

    name = "console.catalog"
    label = "catalog"
    verbose_name = "Models"
