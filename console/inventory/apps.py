from django.apps import AppConfig


class InventoryConfig(AppConfig):
    """Sites (datacenters), nodes, node credentials and the WAN links between sites."""

    name = "console.inventory"
    label = "inventory"
    verbose_name = "Inventory"

    def ready(self) -> None:
        from console.inventory import schema  # noqa: F401 - registers the OpenAPI extension
