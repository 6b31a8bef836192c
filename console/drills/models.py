"""Drills and their reports. A Drill is the standing definition (what to break, for how long,
under which load, judged by which criteria, optionally on a schedule); every execution is a
``runs.WorkflowRun`` with one DrillReport holding the figures the report page charts."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from console.catalog.models import validate_json_object
from console.core.models import Timestamped
from console.drills.choices import DrillKind, ReportState
from console.drills.criteria import failure_line
from console.inventory.models import name_validator


class Drill(Timestamped):
    """One drill definition on a deployment. Written only through ``console.drills.services``
    (which validates ``load_profile``, ``criteria`` and ``targets`` key by key)."""

    name = models.CharField(
        max_length=63,
        unique=True,
        validators=[name_validator],
    )
    deployment = models.ForeignKey(
        "deployments.Deployment",
        on_delete=models.PROTECT,
        related_name="drills",
    )
    kind = models.CharField(
        max_length=16,
        choices=DrillKind.choices,
    )
    site = models.CharField(
        verbose_name="target site",
        max_length=63,
        blank=True,
        help_text="The one prefill site to fault (a site of one of the deployment's prefill "
        "pools): a link cut of that site's WAN path, a restart of its engines; the other sites "
        "keep serving. Empty: every prefill site at once.",
    )
    fault_s = models.FloatField(
        verbose_name="fault duration (s)",
        default=60,
        validators=[MinValueValidator(1), MaxValueValidator(3600)],
        help_text="How long the link stays cut / the remote engines stay down. The agent "
        "restores the fault at this expiry even if the workflow dies.",
    )
    baseline_s = models.FloatField(
        verbose_name="baseline window (s)",
        default=30,
        validators=[MinValueValidator(1), MaxValueValidator(3600)],
    )
    after_s = models.FloatField(
        verbose_name="after window (s)",
        default=30,
        validators=[MinValueValidator(1), MaxValueValidator(3600)],
        help_text="Load kept on after traffic is back on the remote path.",
    )
    recover_timeout_s = models.FloatField(
        verbose_name="recovery timeout (s)",
        default=120,
        validators=[MinValueValidator(1), MaxValueValidator(3600)],
        help_text="Give up waiting for traffic to return to remote after this long.",
    )
    load_profile = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_json_object],
        help_text="Synthetic load (pdbridge loadgen options): concurrency, rate, mix, "
        "min_prompt_tokens, max_prompt_tokens, max_tokens, seed.",
    )
    criteria = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_json_object],
        help_text="Pass/fail criteria: max_failed_requests, max_fallback_requests, "
        "max_time_to_detect_s, max_time_to_recover_s, require_fallback, require_failover, "
        "require_breaker_open, require_recovery, require_verification.",
    )
    targets = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_json_object],
        help_text="Overrides of what is derived from the deployment's pools: gateway_url, "
        "decode_url, prefill_child, verify_prompts.",
    )
    schedule = models.CharField(
        max_length=100,
        blank=True,
        help_text='Cron expression "minute hour day-of-month month day-of-week" (UTC) to run '
        "the drill periodically; empty for on demand only.",
    )
    periodic_task = models.OneToOneField(
        "django_celery_beat.PeriodicTask",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        editable=False,
        related_name="drill",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        editable=False,
        related_name="drills",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


#: The measured figures of a report, as the workflow's ``report`` step hands them over.
REPORT_FIGURES = (
    "requests",
    "total_requests",
    "failed_requests",
    "failures",
    "ttft",
    "time_to_detect_s",
    "time_to_recover_s",
    "breaker",
    "verification",
    "timeline",
    "sites",
)


class DrillReport(models.Model):
    """What one execution of a drill measured, and its verdict against the drill's criteria.

    Created with the run (state ``running``), filled by the workflow's ``report`` step through
    ``services.drill_report_complete``; ``aborted`` when the run fails or is canceled first."""

    drill = models.ForeignKey(
        "drills.Drill",
        on_delete=models.CASCADE,
        related_name="reports",
    )
    run = models.OneToOneField(
        "runs.WorkflowRun",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="drill_report",
    )
    kind = models.CharField(
        max_length=16,
        choices=DrillKind.choices,
    )
    state = models.CharField(
        max_length=16,
        choices=ReportState.choices,
        default=ReportState.RUNNING,
        db_index=True,
    )
    trigger = models.CharField(
        max_length=16,
        default="manual",
        help_text='"manual" (API) or "schedule" (beat).',
    )
    site = models.CharField(
        verbose_name="faulted site",
        max_length=63,
        blank=True,
        help_text="The prefill site this run faulted (the drill's target site when it "
        "started); empty: every prefill site.",
    )
    requests = models.JSONField(
        default=dict,
        blank=True,
        help_text='Requests by window, path and outcome: {"before": {"remote/ok": n, ...}, ...}.',
    )
    total_requests = models.PositiveIntegerField(
        default=0,
    )
    failed_requests = models.PositiveIntegerField(
        default=0,
    )
    failures = models.JSONField(
        default=list,
        blank=True,
        help_text="The failed client requests (time, status, outcome, error), at most 50.",
    )
    ttft = models.JSONField(
        default=dict,
        blank=True,
        help_text="TTFT p50/p99 (s) before, during and after the fault.",
    )
    time_to_detect_s = models.FloatField(
        null=True,
        blank=True,
        help_text="Fault injected -> first token of the first fallback answer.",
    )
    time_to_recover_s = models.FloatField(
        null=True,
        blank=True,
        help_text="Fault restored -> first request served on the remote path again.",
    )
    breaker = models.JSONField(
        default=dict,
        blank=True,
        help_text="Breaker ejections counted by the gateway over the drill.",
    )
    verification = models.JSONField(
        default=dict,
        blank=True,
        help_text="Sample prompts through the gateway vs the decode engine alone.",
    )
    criteria_results = models.JSONField(
        default=list,
        blank=True,
        help_text='[{"criterion", "limit", "value", "passed"}]',
    )
    timeline = models.JSONField(
        default=dict,
        blank=True,
        help_text="Raw timeline for charts: marks and one row per request.",
    )
    sites = models.JSONField(
        default=dict,
        blank=True,
        help_text='Remote answers by prefill site and window, and failovers: {"faulted", '
        '"prefill_sites", "served": {"before": {site: n}, ...}, "failovers": {...}}.',
    )
    error = models.TextField(
        blank=True,
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
        db_index=True,
    )
    finished_at = models.DateTimeField(
        null=True,
        blank=True,
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.drill_id and self.drill.name} report #{self.pk} ({self.state})"

    @property
    def failure_reason(self) -> str:
        """Why a failed report failed, in one line ("" unless failed)."""
        if self.state != ReportState.FAILED:
            return ""
        return failure_line(self.criteria_results or [], self.verification or {})
