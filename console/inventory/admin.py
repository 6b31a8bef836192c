from django.contrib import admin

from console.core.admin_services import ReadOnlyAdmin, ServiceModelAdmin
from console.inventory import services
from console.inventory.models import (
    HEARTBEAT_FIELDS,
    Link,
    LivenessWatch,
    Node,
    NodeCredential,
    Site,
)


@admin.register(Site)
class SiteAdmin(ServiceModelAdmin):
    list_display = ["name", "region", "role", "gpu_hour_price"]
    list_filter = ["role", "region"]
    search_fields = ["name", "region"]
    instance_kwarg = "site"
    create_service = staticmethod(services.site_create)
    update_service = staticmethod(services.site_update)
    delete_service = staticmethod(services.site_delete)


@admin.register(Node)
class NodeAdmin(ServiceModelAdmin):
    list_display = [
        "hostname",
        "site",
        "status",
        "last_heartbeat_at",
        "clock_skew_ms",
        "agent_version",
    ]
    list_filter = ["status", "site", "accelerator_type"]
    search_fields = ["hostname", "agent_address"]
    readonly_fields = HEARTBEAT_FIELDS
    instance_kwarg = "node"
    create_service = staticmethod(services.node_create)
    update_service = staticmethod(services.node_update)
    delete_service = staticmethod(services.node_delete)


@admin.register(Link)
class LinkAdmin(ServiceModelAdmin):
    list_display = [
        "__str__",
        "provisioned_mbit_s",
        "measured_mbit_s",
        "rtt_ms",
        "utilization_ceiling",
        "measured_at",
    ]
    list_filter = ["from_site", "to_site"]
    instance_kwarg = "link"
    create_service = staticmethod(services.link_create)
    update_service = staticmethod(services.link_update)
    delete_service = staticmethod(services.link_delete)


@admin.register(NodeCredential)
class NodeCredentialAdmin(ReadOnlyAdmin):
    """Tokens are issued with POST /api/nodes/{id}/token/; only hashes are stored."""

    list_display = ["node", "token_prefix", "created_by", "created_at", "last_used_at"]
    exclude = ["token_hash"]


@admin.register(LivenessWatch)
class LivenessWatchAdmin(ReadOnlyAdmin):
    """The liveness loop's record: when it last ran and the last outage it held judgement for."""

    list_display = ["checked_at", "blind_since", "blind_until", "blind_reason"]
