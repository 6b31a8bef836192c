from django.contrib import admin

from console.core.admin_services import ReadOnlyAdmin
from console.gatewaykeys.models import GatewayAccess, GatewayKey


@admin.register(GatewayKey)
class GatewayKeyAdmin(ReadOnlyAdmin):
    """Read-only: keys are created and revoked through the API or the console page (the
    services write the audit log and show the key once)."""

    list_display = ["name", "deployment", "key_prefix", "created_at", "revoked_at"]
    list_filter = ["deployment"]


@admin.register(GatewayAccess)
class GatewayAccessAdmin(ReadOnlyAdmin):
    list_display = ["deployment", "require_client_keys", "updated_at"]
