from __future__ import annotations

from typing import Any

from rest_framework import serializers

from console.deployments.choices import PoolRole
from console.deployments.config import resolve_allowed_peers
from console.deployments.models import ConfigSnapshot, Deployment, Pool
from console.inventory.models import Node

DEPLOYMENT_SETTINGS = [
    "remote_prefill_threshold_tokens",
    "remote_share_percent",
    "kill_switch",
    "fallback_to_local_prefill",
    "link_utilization_ceiling",
    "error_rate_limit",
    "latency_p99_limit_ms",
    "chunk_size_mb",
    "compression",
    "checksum",
    "retry",
    "timeout_ms",
    "kv_mode",
    "extra_allowed_peers",
    "chunked_prefill_tokens",
]


class PoolSerializer(serializers.ModelSerializer):
    nodes = serializers.PrimaryKeyRelatedField(
        many=True, queryset=Node.objects.all(), required=False
    )

    class Meta:
        model = Pool
        fields = [
            "id", "deployment", "role", "site", "nodes", "drained_nodes", "engine_settings",
            "created_at",
        ]  # fmt: skip
        read_only_fields = ["created_at", "drained_nodes"]
        # The one-decode-pool and one-pool-per-site rules are checked by the database and
        # reported as 409 / 400 by the service; DRF's generated validators are not needed.
        validators: list[Any] = []

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if self.instance is not None:
            for name in ("deployment", "role"):
                if name in attrs and attrs[name] != getattr(self.instance, name):
                    raise serializers.ValidationError(
                        {name: ["Cannot be changed; delete the pool and create another."]}
                    )
                attrs.pop(name, None)
        return attrs


class PoolDrainSerializer(serializers.Serializer):
    """``POST /api/pools/{id}/drain/``: nodes (ids) to take out of rotation and to put back."""

    drain = serializers.PrimaryKeyRelatedField(many=True, queryset=Node.objects.all(), default=list)
    rejoin = serializers.PrimaryKeyRelatedField(
        many=True, queryset=Node.objects.all(), default=list
    )
    reason = serializers.CharField(max_length=200, default="operator drain")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs["drain"] and not attrs["rejoin"]:
            raise serializers.ValidationError({"drain": ["Name a node to drain or to rejoin."]})
        return attrs


class PoolSummarySerializer(serializers.ModelSerializer):
    site_name = serializers.CharField(source="site.name", read_only=True)

    class Meta:
        model = Pool
        fields = ["id", "role", "site", "site_name", "nodes", "engine_settings"]
        read_only_fields = fields


class DeploymentSerializer(serializers.ModelSerializer):
    pools = PoolSummarySerializer(many=True, read_only=True)
    allowed_peers = serializers.SerializerMethodField(
        help_text="Who may send KV to this deployment's receivers, resolved: the prefill pools' "
        "nodes (their hostnames) and extra_allowed_peers."
    )

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "description",
            "model",
            "state",
            "version",
            *DEPLOYMENT_SETTINGS,
            "allowed_peers",
            "pools",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["state", "version", "kill_switch", "created_at", "updated_at"]

    def get_allowed_peers(self, deployment: Deployment) -> list[str]:
        prefill = [
            {"nodes": [{"hostname": n.hostname} for n in pool.nodes.all()]}
            for pool in deployment.pools.all()
            if pool.role == PoolRole.PREFILL
        ]
        return resolve_allowed_peers(prefill, list(deployment.extra_allowed_peers or []))


class EngineDriftSerializer(serializers.Serializer):
    """A child an active deployment needs that its node does not report running."""

    site = serializers.CharField(help_text="The node's site.")
    node = serializers.CharField(help_text="The node's hostname.")
    child = serializers.CharField(help_text="The child's name on the node's agent.")
    state = serializers.CharField(
        help_text="What the node reports: absent (the reconcile loop launches it again), the "
        "agent's state for it (starting, backoff, held, failed), or 'node <status>' when the "
        "node is not online."
    )


class DeploymentEditedSerializer(DeploymentSerializer):
    """The answer to an edit (update, restore): the deployment, plus what the editor should
    know (``warnings``; the view puts them in the context)."""

    warnings = serializers.SerializerMethodField(
        help_text="Things the editor should know, e.g. that a canary in progress drives the "
        "remote share (it pauses instead of overwriting the edit). Empty when none."
    )

    class Meta(DeploymentSerializer.Meta):
        fields = [*DeploymentSerializer.Meta.fields, "warnings"]

    def get_warnings(self, deployment: Deployment) -> list[str]:
        return list(self.context.get("warnings", []))


class SnapshotSerializer(serializers.ModelSerializer):
    class Meta:
        model = ConfigSnapshot
        fields = ["version", "created_at", "author_label", "reason", "diff"]
        read_only_fields = fields


class RestoreSerializer(serializers.Serializer):
    version = serializers.IntegerField(min_value=1)


class KillSwitchSerializer(serializers.Serializer):
    enabled = serializers.BooleanField()


class KillSwitchResponseSerializer(serializers.Serializer):
    kill_switch = serializers.BooleanField()
    version = serializers.IntegerField()


class WorkflowStartSerializer(serializers.Serializer):
    """Body of ``deploy`` and ``canary`` starts: optional run parameters (validated by the
    service, which names the offending key)."""

    params = serializers.DictField(required=False, default=dict)
