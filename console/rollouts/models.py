"""Rollout plans: ordered canary steps (remote share, minimum soak time and request count)
and the gates every step must pass against the local-only baseline."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from console.core.models import Timestamped
from console.inventory.models import validate_fraction

DEFAULT_PLAN_NAME = "default"


def default_steps() -> list[dict[str, int]]:
    """The guide's 1 -> 10 -> 50 -> 100 canary."""
    return [
        {"share_percent": 1, "min_duration_s": 300, "min_requests": 100},
        {"share_percent": 10, "min_duration_s": 600, "min_requests": 1000},
        {"share_percent": 50, "min_duration_s": 900, "min_requests": 5000},
        {"share_percent": 100, "min_duration_s": 0, "min_requests": 0},
    ]


class RolloutPlan(Timestamped):
    """How a deployment's remote share is raised. A deployment without its own plan uses the
    plan named ``default`` (created by ``services.rollout_plan_default``)."""

    name = models.CharField(
        max_length=100,
        unique=True,
    )
    deployment = models.OneToOneField(
        "deployments.Deployment",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="rollout_plan",
        help_text="Empty for a shared plan (such as the default).",
    )
    steps = models.JSONField(
        default=default_steps,
        help_text='Ordered [{"share_percent", "min_duration_s", "min_requests"}], shares '
        "strictly increasing and ending at 100.",
    )
    gate_ttft_p50_ratio = models.FloatField(
        verbose_name="TTFT p50 ratio gate",
        default=1.2,
        validators=[MinValueValidator(0.01), MaxValueValidator(100)],
        help_text="Fail the step if remote TTFT p50 exceeds this multiple of the local baseline.",
    )
    gate_ttft_p99_ratio = models.FloatField(
        verbose_name="TTFT p99 ratio gate",
        default=1.5,
        validators=[MinValueValidator(0.01), MaxValueValidator(100)],
    )
    gate_success_rate_min = models.FloatField(
        verbose_name="success-rate floor",
        default=0.99,
        validators=[validate_fraction],
    )
    gate_link_utilization_max = models.FloatField(
        verbose_name="link-utilisation ceiling",
        default=0.7,
        validators=[validate_fraction],
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
