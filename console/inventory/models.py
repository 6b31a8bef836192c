"""Inventory: where things run. Sites, their nodes (with liveness from heartbeats), the
per-node credential agents authenticate with, and the measured WAN links between sites."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from console.core.models import Timestamped
from console.inventory.choices import NodeStatus, SiteRole

name_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,62}$",
    "Use lower-case letters, digits, '.', '_' or '-' (at most 63 characters).",
)
address_validator = RegexValidator(
    r"^[A-Za-z0-9._:\[\]-]+:[0-9]{1,5}$",
    "Expected host:port (for example 10.0.0.5:7070).",
)


def validate_fraction(value: float) -> None:
    """A share in (0, 1] (utilisation ceilings)."""
    if not 0 < value <= 1:
        raise ValidationError("Must be greater than 0 and at most 1.")


# Node fields written only by heartbeats and the liveness check (read-only everywhere else).
HEARTBEAT_FIELDS = [
    "status",
    "last_heartbeat_at",
    "agent_version",
    "clock_skew_ms",
    "reported_capacity",
    "reported_children",
    "reported_faults",
    "reported_config_versions",
    "reported_tls",
    "reported_weights",
]


class Site(Timestamped):
    """A datacenter: decode near users, prefill in a compute-dense region, or both."""

    name = models.CharField(
        max_length=63,
        unique=True,
        validators=[name_validator],
    )
    region = models.CharField(
        max_length=100,
        blank=True,
    )
    role = models.CharField(
        max_length=16,
        choices=SiteRole.choices,
        default=SiteRole.BOTH,
    )
    gpu_hour_price = models.DecimalField(
        verbose_name="GPU-hour price",
        max_digits=10,
        decimal_places=4,
        default=0,
        validators=[MinValueValidator(0)],
        help_text="Price of one accelerator for one hour, in the operator's currency.",
    )
    notes = models.TextField(
        blank=True,
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Node(Timestamped):
    """A machine with an agent. ``status`` and the ``reported_*`` fields come from heartbeats."""

    site = models.ForeignKey(
        "inventory.Site",
        on_delete=models.PROTECT,
        related_name="nodes",
    )
    hostname = models.CharField(
        max_length=253,
        validators=[RegexValidator(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}$", "Not a valid hostname.")],
    )
    agent_address = models.CharField(
        max_length=270,
        validators=[address_validator],
        help_text="host:port of the node agent's control API.",
    )
    accelerator_type = models.CharField(
        max_length=64,
        blank=True,
        help_text="For example H200, H20, L40S; empty for CPU-only nodes.",
    )
    accelerator_count = models.PositiveIntegerField(
        default=0,
        validators=[MaxValueValidator(1024)],
    )
    accelerator_memory_gib = models.FloatField(
        verbose_name="accelerator memory (GiB)",
        default=0,
        validators=[MinValueValidator(0)],
        help_text="Memory of one accelerator.",
    )
    dense_tflops = models.FloatField(
        verbose_name="dense TFLOP/s",
        default=0,
        validators=[MinValueValidator(0)],
        help_text="Dense BF16 TFLOP/s of one accelerator.",
    )
    memory_bandwidth_gbs = models.FloatField(
        verbose_name="memory bandwidth (GB/s)",
        default=0,
        validators=[MinValueValidator(0)],
        help_text="Memory bandwidth of one accelerator.",
    )
    status = models.CharField(
        max_length=16,
        choices=NodeStatus.choices,
        default=NodeStatus.UNKNOWN,
        editable=False,
    )
    last_heartbeat_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
    )
    agent_version = models.CharField(
        max_length=64,
        blank=True,
        editable=False,
    )
    reported_capacity = models.JSONField(
        encoder=DjangoJSONEncoder,
        default=dict,
        blank=True,
        editable=False,
    )
    reported_children = models.JSONField(
        encoder=DjangoJSONEncoder,
        default=list,
        blank=True,
        editable=False,
    )
    reported_faults = models.JSONField(
        encoder=DjangoJSONEncoder,
        default=list,
        blank=True,
        editable=False,
    )
    reported_config_versions = models.JSONField(
        encoder=DjangoJSONEncoder,
        default=dict,
        blank=True,
        editable=False,
        help_text="Deployment id -> config version the agent runs.",
    )
    reported_tls = models.JSONField(
        encoder=DjangoJSONEncoder,
        null=True,
        blank=True,
        editable=False,
        help_text="mTLS on or off, certificate subject, SANs, not-after, CA fingerprint and "
        "allowlist size; null until the agent reports it.",
    )
    reported_weights = models.JSONField(
        encoder=DjangoJSONEncoder,
        null=True,
        blank=True,
        editable=False,
        help_text="sha256 of the weights of each model the node holds or serves; null until "
        "the agent reports it.",
    )
    clock_skew_ms = models.FloatField(
        null=True,
        blank=True,
        editable=False,
        help_text="Node clock minus console clock at the last heartbeat (ms).",
    )

    class Meta:
        ordering = ["site__name", "hostname"]
        constraints = [
            models.UniqueConstraint(
                fields=["site", "hostname"], name="node_unique_hostname_per_site"
            )
        ]

    def __str__(self) -> str:
        return f"{self.hostname}@{self.site_id and self.site.name}"


class NodeCredential(models.Model):
    """The hash of a node's bearer token. The token itself is shown once, when issued."""

    node = models.OneToOneField(
        "inventory.Node",
        on_delete=models.CASCADE,
        related_name="credential",
    )
    token_hash = models.CharField(
        max_length=64,
        unique=True,
        help_text="sha256 hex of the token (tokens are 256-bit random, so no slow hash is needed).",
    )
    token_prefix = models.CharField(
        max_length=8,
        help_text="First characters of the token, to tell tokens apart in logs.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="node_credentials",
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
    )
    last_used_at = models.DateTimeField(
        null=True,
        blank=True,
    )

    def __str__(self) -> str:
        return f"credential of {self.node} ({self.token_prefix}...)"


class Link(Timestamped):
    """The WAN path from one site to another (ordered: KV flows prefill site -> decode site)."""

    from_site = models.ForeignKey(
        "inventory.Site",
        on_delete=models.PROTECT,
        related_name="links_out",
    )
    to_site = models.ForeignKey(
        "inventory.Site",
        on_delete=models.PROTECT,
        related_name="links_in",
    )
    provisioned_mbit_s = models.PositiveIntegerField(
        verbose_name="provisioned Mbit/s",
        validators=[MinValueValidator(1)],
    )
    measured_mbit_s = models.FloatField(
        verbose_name="measured Mbit/s",
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
    )
    rtt_ms = models.FloatField(
        verbose_name="RTT (ms)",
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
    )
    utilization_ceiling = models.FloatField(
        default=0.7,
        validators=[validate_fraction],
        help_text="Share of the link KV transfers may use, in (0, 1].",
    )
    measured_at = models.DateTimeField(
        null=True,
        blank=True,
    )

    class Meta:
        ordering = ["from_site__name", "to_site__name"]
        constraints = [
            models.UniqueConstraint(fields=["from_site", "to_site"], name="link_unique_site_pair"),
            models.CheckConstraint(
                condition=~models.Q(from_site=models.F("to_site")),
                name="link_distinct_sites",
                violation_error_message="A link joins two different sites.",
            ),
            models.CheckConstraint(
                condition=models.Q(utilization_ceiling__gt=0, utilization_ceiling__lte=1),
                name="link_ceiling_range",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.from_site_id and self.from_site.name} -> {self.to_site_id and self.to_site.name}"

    @property
    def measurement_stale(self) -> bool:
        """No measurement, or one older than three periods of the link probe job
        (``LINK_PROBE_S``): the job has not run, or every round was skipped or failed."""
        if self.measured_at is None:
            return True
        age = (timezone.now() - self.measured_at).total_seconds()
        return age > 3 * settings.LINK_PROBE_S


class LivenessWatch(models.Model):
    """The liveness loop's own record (a single row, ``pk=1``): when it last judged the nodes,
    and the last window in which the console could not hear heartbeats (its probe of the
    console's listener failed, or the loop itself did not run). A node whose last beat is
    older than that window is not judged until ``HEARTBEAT_OUTAGE_GRACE_S`` after it: an
    outage of the console is not blamed on the nodes (:mod:`console.inventory.liveness`)."""

    checked_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the loop last judged the nodes.",
    )
    blind_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Start of the outage in progress (null: the console hears heartbeats).",
    )
    blind_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Last moment the console was known not to hear heartbeats.",
    )
    blind_reason = models.CharField(
        max_length=300,
        blank=True,
        help_text="Why the console was taken to be deaf then (the probe's error, or the gap).",
    )

    class Meta:
        verbose_name = "liveness watch"

    def __str__(self) -> str:
        return f"liveness watch (checked {self.checked_at}, blind until {self.blind_until})"
