from django.db import models


class SiteRole(models.TextChoices):
    """What a site may host."""

    # Near users: decode engines, the gateway, local prefill fallback.
    DECODE = "decode", "Decode"
    # Compute-dense remote datacenter: prefill engines only.
    PREFILL = "prefill", "Prefill"
    # Either pool kind.
    BOTH = "both", "Both"


class NodeStatus(models.TextChoices):
    """Liveness, derived from heartbeats only (never set by hand)."""

    # Registered, no heartbeat received yet.
    UNKNOWN = "unknown", "Unknown"
    # Heartbeats arriving on time.
    ONLINE = "online", "Online"
    # One heartbeat interval missed (and a half interval of grace).
    DEGRADED = "degraded", "Degraded"
    # HEARTBEAT_MISSED_LIMIT intervals missed: treated as gone by routing and workflows.
    LOST = "lost", "Lost"
