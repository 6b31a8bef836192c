from django.apps import AppConfig


class GatewayKeysConfig(AppConfig):
    """Client API keys of the gateways (stored as hashes; the key is shown once) and each
    deployment's ``require_client_keys`` flag, served to the gateway with the hashes."""

    name = "console.gatewaykeys"
    label = "gatewaykeys"
    verbose_name = "Gateway keys"

    def ready(self) -> None:
        from console.core.choices import Role
        from console.core.nav import NavItem, nav_register

        nav_register(NavItem("Gateway keys", "gateway-keys-page", Role.VIEWER, order=85))
