from __future__ import annotations

from typing import Any

from django.utils.dateparse import parse_datetime
from rest_framework import serializers

from console.inventory import agentlogs
from console.inventory.models import HEARTBEAT_FIELDS, Link, Node, Site

MAX_REPORT_ITEMS = 256


class SiteSerializer(serializers.ModelSerializer):
    class Meta:
        model = Site
        fields = [
            "id",
            "name",
            "region",
            "role",
            "gpu_hour_price",
            "notes",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]


class NodeSerializer(serializers.ModelSerializer):
    has_token = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id",
            "site",
            "hostname",
            "agent_address",
            "accelerator_type",
            "accelerator_count",
            "accelerator_memory_gib",
            "dense_tflops",
            "memory_bandwidth_gbs",
            *HEARTBEAT_FIELDS,
            "has_token",
            "created_at",
            "updated_at",
        ]
        read_only_fields = [*HEARTBEAT_FIELDS, "created_at", "updated_at"]

    def get_has_token(self, obj: Node) -> bool:
        return hasattr(obj, "credential")


class NodeTokenSerializer(serializers.Serializer):
    """The answer to a token issue: the token is shown this once."""

    node = serializers.IntegerField()
    token = serializers.CharField()
    token_prefix = serializers.CharField()


class LinkSerializer(serializers.ModelSerializer):
    class Meta:
        model = Link
        fields = [
            "id",
            "from_site",
            "to_site",
            "provisioned_mbit_s",
            "measured_mbit_s",
            "rtt_ms",
            "utilization_ceiling",
            "measured_at",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        from_site = attrs.get("from_site", getattr(self.instance, "from_site", None))
        to_site = attrs.get("to_site", getattr(self.instance, "to_site", None))
        if from_site is not None and from_site == to_site:
            raise serializers.ValidationError({"to_site": ["A link joins two different sites."]})
        return attrs


class AwareDateTimeField(serializers.DateTimeField):
    """An ISO 8601 datetime that must carry its offset: a clock without one cannot be
    compared across sites."""

    def to_internal_value(self, value: Any) -> Any:
        if isinstance(value, str):
            try:
                parsed = parse_datetime(value.strip())
            except ValueError:  # well-formed but impossible (offset +25:00, month 13)
                raise serializers.ValidationError("Not a valid date and time.") from None
            if parsed is not None and parsed.tzinfo is None:
                raise serializers.ValidationError(
                    "Must carry a timezone offset (for example ...Z)."
                )
        return super().to_internal_value(value)


class ChildReportSerializer(serializers.Serializer):
    """One process the agent supervises."""

    name = serializers.CharField(max_length=100)
    kind = serializers.CharField(max_length=64)
    state = serializers.CharField(max_length=32)
    pid = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    port = serializers.IntegerField(min_value=0, max_value=65535, required=False, allow_null=True)
    healthy = serializers.BooleanField(required=False, allow_null=True)
    restarts = serializers.IntegerField(min_value=0, required=False, default=0)
    config_version = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    deployment_id = serializers.IntegerField(min_value=0, required=False, allow_null=True)


class TlsReportSerializer(serializers.Serializer):
    """The agent's TLS state (docs/agent.md, "Heartbeats")."""

    mtls = serializers.BooleanField()
    subject = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")
    sans = serializers.ListField(
        child=serializers.CharField(max_length=300), required=False, default=list, max_length=64
    )
    not_after = AwareDateTimeField(required=False, allow_null=True, default=None)
    ca_fingerprint = serializers.RegexField(
        r"^([0-9a-f]{64})?$", required=False, allow_blank=True, default=""
    )
    allowlist_size = serializers.IntegerField(min_value=0, required=False, default=0)
    error = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")


class WeightsReportSerializer(serializers.Serializer):
    """The sha256 of one model's weights on the node (held, or served by an engine child)."""

    STATES = ("ok", "hashing", "error")

    model = serializers.CharField(max_length=200)
    child = serializers.CharField(max_length=100, required=False, allow_null=True, default=None)
    path = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")
    state = serializers.ChoiceField(choices=STATES)
    sha256 = serializers.RegexField(
        r"^[0-9a-f]{64}$", required=False, allow_null=True, default=None
    )
    detail = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["state"] == "ok" and not attrs.get("sha256"):
            raise serializers.ValidationError({"sha256": ["Required when state is ok."]})
        return attrs


class FaultReportSerializer(serializers.Serializer):
    """One fault injection active on the node (drills)."""

    id = serializers.CharField(max_length=100)
    kind = serializers.CharField(max_length=64)
    target = serializers.CharField(
        max_length=200, required=False, allow_blank=True, allow_null=True
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True)


class HeartbeatSerializer(serializers.Serializer):
    """The heartbeat body (docs/api.md, "Node heartbeat")."""

    agent_version = serializers.CharField(max_length=64)
    clock = AwareDateTimeField()
    capacity = serializers.DictField(required=False, default=dict)
    children = ChildReportSerializer(
        many=True, required=False, default=list, max_length=MAX_REPORT_ITEMS
    )
    faults = FaultReportSerializer(
        many=True, required=False, default=list, max_length=MAX_REPORT_ITEMS
    )
    config_versions = serializers.DictField(
        child=serializers.IntegerField(min_value=0), required=False, default=dict
    )
    # Optional: an agent older than these reports leaves them null ("not reported yet").
    tls = TlsReportSerializer(required=False, allow_null=True, default=None)
    weights = WeightsReportSerializer(
        many=True, required=False, allow_null=True, default=None, max_length=MAX_REPORT_ITEMS
    )
    # Where the agent's control API listens now (an agent restarted on another port says so):
    # its listen host (a wildcard keeps the registered host) and bound port.
    agent_listen_host = serializers.RegexField(
        r"^[A-Za-z0-9._:\[\]-]*$",
        max_length=253,
        required=False,
        allow_blank=True,
        default="",
        error_messages={"invalid": "Not a host name or address."},
    )
    agent_port = serializers.IntegerField(
        min_value=1, max_value=65535, required=False, allow_null=True, default=None
    )

    def validate_config_versions(self, value: dict[str, int]) -> dict[str, int]:
        bad = sorted(k for k in value if not (k.isascii() and k.isdigit()))
        if bad:
            raise serializers.ValidationError(f"Keys are deployment ids; got {bad[0]!r}.")
        return value


class HeartbeatResponseSerializer(serializers.Serializer):
    node = serializers.IntegerField()
    status = serializers.CharField()
    clock_skew_ms = serializers.FloatField()
    interval_s = serializers.IntegerField()
    deployments = serializers.DictField(child=serializers.IntegerField())


class LogQuerySerializer(serializers.Serializer):
    """The query of a process's log (the log page and ``GET /api/nodes/{id}/logs/{child}/``)."""

    q = serializers.CharField(
        required=False,
        default="",
        allow_blank=True,
        trim_whitespace=False,
        max_length=agentlogs.MAX_SEARCH,
        help_text="Keep the lines containing this text (plain, case-sensitive), e.g. a request id.",
        error_messages={"max_length": f"one line of at most {agentlogs.MAX_SEARCH} characters"},
    )
    size = serializers.ChoiceField(
        choices=list(agentlogs.SIZES),
        default=agentlogs.DEFAULT_SIZE,
        help_text="How many bytes of the log to read, ending at `before` (or at its end).",
        error_messages={"invalid_choice": f"one of {', '.join(agentlogs.SIZES)}"},
    )
    before = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=2**62,
        help_text="Read the bytes before this offset of the log stream (an answer's `earlier`).",
        error_messages={
            "invalid": "a byte offset (digits)",
            "min_value": "a byte offset (digits)",
            "max_value": "a byte offset (digits)",
        },
    )

    def validate_q(self, value: str) -> str:
        if "\n" in value or "\r" in value:
            raise serializers.ValidationError(
                f"one line of at most {agentlogs.MAX_SEARCH} characters"
            )
        return value


class LogExcerptSerializer(serializers.Serializer):
    """Whole lines of a process's log, read through its node's agent."""

    node = serializers.IntegerField()
    child = serializers.CharField()
    lines = serializers.ListField(child=serializers.CharField(allow_blank=True))
    search = serializers.CharField(allow_blank=True, help_text="The `q` the lines were kept by.")
    matched = serializers.IntegerField(help_text="Lines kept (all of `total` without `q`).")
    total = serializers.IntegerField(help_text="Whole lines in the bytes read.")
    offset = serializers.IntegerField(help_text="Byte offset of the first line read.")
    end = serializers.IntegerField(help_text="Byte offset just after the bytes read.")
    start_offset = serializers.IntegerField(help_text="The oldest byte still on the node.")
    earlier = serializers.IntegerField(
        allow_null=True, help_text="Pass as `before` to read what precedes; null at the oldest."
    )
