"""Tidal schedules, per-site hourly price tables, the record of each hour applied, and
rebalancing proposals. Written only by ``console.schedules.services``."""

from __future__ import annotations

import zoneinfo

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from console.core.models import Timestamped
from console.schedules.choices import ApplicationOutcome, ProposalState


def validate_timezone(value: str) -> None:
    """An IANA zone name (``Europe/Paris``, ``UTC``)."""
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):  # OSError: absurd names
        raise ValidationError(f"Unknown time zone {value!r} (use an IANA name).") from None


def default_capacity() -> list[int]:
    return [0] * 24


class SitePriceTable(Timestamped):
    """What one accelerator costs at a site, hour by hour of the day (the site's local time
    as the schedule states it). Energy is optional: ``kWh price x kW per GPU`` is added."""

    site = models.OneToOneField(
        "inventory.Site",
        on_delete=models.CASCADE,
        related_name="price_table",
    )
    gpu_hour_prices = models.JSONField(
        help_text="24 prices per GPU-hour, index = hour of the day (0-23).",
    )
    energy_prices_kwh = models.JSONField(
        default=list,
        blank=True,
        help_text="Optional: 24 energy prices per kWh (empty: no energy term).",
    )
    kw_per_gpu = models.FloatField(
        default=0.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(100.0)],
        help_text="Power draw of one accelerator in kW (used with the energy prices).",
    )

    class Meta:
        ordering = ["site_id"]
        verbose_name = "site price table"

    def __str__(self) -> str:
        return f"prices @ {self.site_id and self.site.name}"

    def gpu_hour_price(self, hour: int) -> float:
        """Price of one GPU for hour ``hour``, energy included."""
        price = float(self.gpu_hour_prices[hour])
        if self.energy_prices_kwh:
            price += float(self.energy_prices_kwh[hour]) * self.kw_per_gpu
        return price


class TidalSchedule(Timestamped):
    """Moves prefill to the cheaper site by the hour for one deployment. The planner scenario
    describes the deployment's hardware, lengths and link; ``capacity`` bounds the remote
    instances each hour; the beat applies the hour's plan when ``enabled``."""

    deployment = models.OneToOneField(
        "deployments.Deployment",
        on_delete=models.CASCADE,
        related_name="tidal_schedule",
    )
    enabled = models.BooleanField(
        default=False,
        help_text="Beat applies the hour's plan only when on (what-if works either way).",
    )
    timezone = models.CharField(
        max_length=64,
        default="UTC",
        validators=[validate_timezone],
        help_text="IANA zone whose hours index the price tables and the capacity window.",
    )
    ttft_limit_ms = models.PositiveIntegerField(
        default=3000,
        validators=[MinValueValidator(1), MaxValueValidator(3_600_000)],
        help_text="Worst-path mean TTFT estimate a plan may have.",
    )
    scenario = models.JSONField(
        help_text="A planner evaluate body (docs/planner.md); remote.instances is set per hour.",
    )
    remote_site = models.ForeignKey(
        "inventory.Site",
        on_delete=models.PROTECT,
        related_name="tidal_remote_schedules",
    )
    local_site = models.ForeignKey(
        "inventory.Site",
        on_delete=models.PROTECT,
        related_name="tidal_local_schedules",
    )
    gpus_per_instance = models.PositiveSmallIntegerField(
        default=8,
        validators=[MinValueValidator(1), MaxValueValidator(64)],
    )
    capacity = models.JSONField(
        default=default_capacity,
        help_text="24 counts: remote prefill instances available in each hour (capacity window).",
    )
    demand_rps = models.JSONField(
        default=list,
        blank=True,
        help_text="Optional: 24 expected request rates (requests/s); empty plans for full load.",
    )
    rtt_ms = models.FloatField(
        default=0.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(10_000.0)],
        help_text="WAN round trip added to the remote path's TTFT estimate.",
    )
    rebalance_auto_apply = models.BooleanField(
        default=False,
        help_text="Apply rebalancing proposals at once instead of waiting for an operator.",
    )

    class Meta:
        ordering = ["deployment_id"]

    def __str__(self) -> str:
        return f"tidal {self.deployment_id and self.deployment.name}"


class TidalApplication(models.Model):
    """What the beat did for one schedule in one hour (unique per hour: the apply is
    idempotent, a second tick in the same hour finds this row)."""

    schedule = models.ForeignKey(
        "schedules.TidalSchedule",
        on_delete=models.CASCADE,
        related_name="applications",
    )
    hour_start = models.DateTimeField(
        help_text="Start of the schedule-local hour this row is about.",
    )
    hour = models.PositiveSmallIntegerField(
        help_text="Hour of the day in the schedule's zone (0-23).",
    )
    outcome = models.CharField(
        max_length=24,
        choices=ApplicationOutcome.choices,
    )
    plan = models.JSONField(
        default=dict,
        help_text="The hour's plan as the policy computed it.",
    )
    before = models.JSONField(
        default=dict,
    )
    after = models.JSONField(
        default=dict,
    )
    config_version = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The deployment's config version after the apply.",
    )
    scale = models.JSONField(
        default=dict,
        help_text="Remote pool scale intent: nodes to run and to stop, and what was called.",
    )
    error = models.TextField(
        blank=True,
    )
    checks = models.PositiveIntegerField(
        default=1,
        help_text="Beat ticks that looked at this hour.",
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
    )
    updated_at = models.DateTimeField(
        auto_now=True,
    )

    class Meta:
        ordering = ["-hour_start", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["schedule", "hour_start"], name="tidal_application_one_per_hour"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.schedule} {self.hour_start:%Y-%m-%d %H:00} {self.outcome}"


class RebalanceProposal(models.Model):
    """A proposed change of the local pool's prefill / decode split, with its reason (the
    measured producer and consumer throughput against the planner's optimum)."""

    deployment = models.ForeignKey(
        "deployments.Deployment",
        on_delete=models.CASCADE,
        related_name="rebalance_proposals",
    )
    state = models.CharField(
        max_length=16,
        choices=ProposalState.choices,
        default=ProposalState.PROPOSED,
    )
    measured = models.JSONField(
        default=dict,
        help_text="Producer / consumer throughput from telemetry, and the window.",
    )
    current_split = models.JSONField(
        default=dict,
    )
    target_split = models.JSONField(
        default=dict,
    )
    moves = models.JSONField(
        default=list,
        help_text="Nodes to convert: [{node, hostname, from, to}].",
    )
    reason = models.TextField()
    run = models.ForeignKey(
        "runs.WorkflowRun",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="The rebalance run carrying it out (once approved).",
    )
    decided_by_label = models.CharField(
        max_length=150,
        blank=True,
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
    )
    decided_at = models.DateTimeField(
        null=True,
        blank=True,
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment"],
                condition=models.Q(state="proposed"),
                name="rebalance_one_open_per_deployment",
            ),
        ]

    def __str__(self) -> str:
        return f"rebalance #{self.pk} {self.deployment_id and self.deployment.name} ({self.state})"
