"""Deployments: a model served by one local decode pool and one or more remote prefill pools,
with the routing / circuit-breaker / KV-transfer / prefill settings the data plane reads, and
the immutable numbered snapshots of that configuration."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from console.catalog.models import validate_json_object
from console.core.models import Timestamped
from console.deployments.choices import Compression, DeploymentState, KvMode, PoolRole
from console.inventory.models import name_validator, validate_fraction

#: The longest certificate name accepted in an allowlist (a DNS name's limit).
PEER_NAME_MAX = 253


def validate_peer_names(value: object) -> None:
    """A list of certificate common names (the identity KV receivers match; a SAN never
    matches): non-empty strings without leading or trailing whitespace (a pasted name that
    could never match), at most 253 characters, no duplicates."""
    if not isinstance(value, list):
        raise ValidationError("Must be a list of certificate names (common names, not SANs).")
    for index, name in enumerate(value):
        if not isinstance(name, str) or not name.strip():
            raise ValidationError(f"Item {index}: must be a non-empty string, got {name!r}.")
        if name != name.strip():
            raise ValidationError(f"Item {index}: {name!r} has leading or trailing whitespace.")
        if len(name) > PEER_NAME_MAX:
            raise ValidationError(f"Item {index}: longer than {PEER_NAME_MAX} characters.")
    duplicates = sorted({n for n in value if value.count(n) > 1})
    if duplicates:
        raise ValidationError(f"Listed more than once: {', '.join(duplicates)}.")


class Deployment(Timestamped):
    """What should run and how traffic is routed. Every change goes through
    ``services`` so that ``version`` goes up by one and a ``ConfigSnapshot`` is written."""

    name = models.CharField(
        max_length=63,
        unique=True,
        validators=[name_validator],
    )
    description = models.TextField(
        blank=True,
    )
    model = models.ForeignKey(
        "catalog.ModelSpec",
        on_delete=models.PROTECT,
        related_name="deployments",
    )
    state = models.CharField(
        max_length=16,
        choices=DeploymentState.choices,
        default=DeploymentState.DRAFT,
        editable=False,
    )
    # routing
    remote_prefill_threshold_tokens = models.PositiveIntegerField(
        default=4096,
        validators=[MaxValueValidator(10_000_000)],
        help_text="Incremental prompt length at or above which prefill may go remote.",
    )
    remote_share_percent = models.PositiveSmallIntegerField(
        default=0,
        validators=[MaxValueValidator(100)],
        help_text="Share of eligible requests sent remote (the canary dial), 0-100.",
    )
    kill_switch = models.BooleanField(
        default=False,
        help_text="Everything local, now.",
    )
    fallback_to_local_prefill = models.BooleanField(
        default=True,
    )
    link_utilization_ceiling = models.FloatField(
        default=0.7,
        validators=[validate_fraction],
        help_text="Do not route remote when the chosen link is above this share, in (0, 1].",
    )
    # circuit breaker
    error_rate_limit = models.FloatField(
        default=0.05,
        validators=[validate_fraction],
        help_text="Open the breaker above this remote error rate, in (0, 1].",
    )
    latency_p99_limit_ms = models.PositiveIntegerField(
        default=2500,
        validators=[MinValueValidator(1), MaxValueValidator(3_600_000)],
    )
    # KV transfer
    chunk_size_mb = models.PositiveIntegerField(
        default=32,
        validators=[MinValueValidator(1), MaxValueValidator(1024)],
    )
    compression = models.CharField(
        max_length=16,
        choices=Compression.choices,
        default=Compression.AUTO,
    )
    checksum = models.BooleanField(
        default=True,
    )
    retry = models.PositiveSmallIntegerField(
        default=3,
        validators=[MaxValueValidator(100)],
    )
    timeout_ms = models.PositiveIntegerField(
        default=4000,
        validators=[MinValueValidator(1), MaxValueValidator(3_600_000)],
    )
    kv_mode = models.CharField(
        max_length=8,
        choices=KvMode.choices,
        default=KvMode.PUSH,
        help_text="push: pdbridge engines (both legs at once); pull: vLLM's built-in connectors "
        "(prefill first, its kv_transfer_params handed to the decode leg).",
    )
    extra_allowed_peers = models.JSONField(
        verbose_name="extra KV senders",
        default=list,
        blank=True,
        validators=[validate_peer_names],
        help_text="Certificate names (CN or SAN) allowed to send KV to this deployment's "
        "receivers (the decode engines' KV listeners and the kv-link) besides the prefill "
        "pools' nodes, which are always allowed.",
    )
    # prefill
    chunked_prefill_tokens = models.PositiveIntegerField(
        default=2048,
        validators=[MinValueValidator(1), MaxValueValidator(10_000_000)],
    )
    baseline = models.JSONField(
        default=dict,
        blank=True,
        editable=False,
        help_text="Capacity baseline written by step 1 of the deployment workflow (KV bytes per "
        "request, bandwidth needed, instance counts, threshold); not part of the config document.",
    )
    version = models.PositiveIntegerField(
        default=1,
        editable=False,
        help_text="Config version: +1 per change; writes may name it (If-Match) to avoid lost updates.",
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(remote_share_percent__lte=100),
                name="deployment_share_range",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class Pool(models.Model):
    """A group of engines of one role at one site, serving one deployment."""

    deployment = models.ForeignKey(
        "deployments.Deployment",
        on_delete=models.CASCADE,
        related_name="pools",
    )
    role = models.CharField(
        max_length=16,
        choices=PoolRole.choices,
    )
    site = models.ForeignKey(
        "inventory.Site",
        on_delete=models.PROTECT,
        related_name="pools",
    )
    nodes = models.ManyToManyField(
        "inventory.Node",
        blank=True,
        related_name="pools",
    )
    engine_settings = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_json_object],
        help_text="Engine options for this pool (merged over the model's).",
    )
    drained_nodes = models.ManyToManyField(
        "inventory.Node",
        blank=True,
        related_name="drained_in_pools",
        verbose_name="drained nodes",
        help_text=(
            "Nodes of this pool out of the gateways' rotation: drained before their engine "
            "is stopped, standby until it is healthy again (docs/gateway.md, Draining)."
        ),
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
    )

    class Meta:
        ordering = ["deployment_id", "role", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment"],
                condition=models.Q(role="decode"),
                name="pool_one_decode_per_deployment",
                violation_error_message="A deployment has exactly one decode pool.",
            ),
            models.UniqueConstraint(
                fields=["deployment", "role", "site"],
                name="pool_unique_role_site",
                violation_error_message="This deployment already has a pool of this role at this site.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id and self.deployment.name} {self.role}@{self.site_id and self.site.name}"


class ConfigSnapshot(models.Model):
    """One immutable version of a deployment's data-plane configuration. Written only by
    the deployment services, never changed afterwards."""

    deployment = models.ForeignKey(
        "deployments.Deployment",
        on_delete=models.CASCADE,
        related_name="snapshots",
    )
    version = models.PositiveIntegerField()
    config = models.JSONField(
        help_text="The config document (docs/api.md), without version and created_at.",
    )
    diff = models.JSONField(
        default=dict,
        help_text='Dotted path -> {"from": old, "to": new} against the previous version.',
    )
    reason = models.CharField(
        max_length=200,
        blank=True,
        help_text="Why this version exists (update, restore of v3, node changed ...).",
    )
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="config_snapshots",
    )
    author_label = models.CharField(
        max_length=150,
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
    )

    class Meta:
        ordering = ["deployment_id", "-version"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment", "version"], name="snapshot_unique_version"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id and self.deployment.name} v{self.version}"
