from django.apps import AppConfig


class InventoryConfig(AppConfig):
    """Sites (datacenters), nodes, node credentials and the WAN links between sites."""

    name = "console.inventory"
    label = "inventory"
    verbose_name = "Inventory"
