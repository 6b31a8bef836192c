"""Alert rules, alerts (firing and resolved: the history) and notification channels.
Written only by ``console.alerts.services``."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from console.alerts.choices import (
    Aggregate,
    AlertLayer,
    AlertLevel,
    AlertState,
    ChannelKind,
    Comparison,
)
from console.core.models import Timestamped
from console.inventory.models import name_validator


class AlertRule(Timestamped):
    """Fires for each subject whose ``aggregate`` of ``metric`` over the last ``window_s``
    seconds compares true against ``threshold``."""

    name = models.CharField(
        max_length=63,
        unique=True,
        validators=[name_validator],
    )
    layer = models.CharField(
        max_length=16,
        choices=AlertLayer.choices,
    )
    level = models.CharField(
        max_length=16,
        choices=AlertLevel.choices,
    )
    metric = models.CharField(
        max_length=100,
        help_text="Telemetry metric name (Prometheus conventions, base units).",
    )
    subject_type = models.CharField(
        max_length=100,
        blank=True,
        help_text="Only samples about this kind of subject (inventory.node ...); empty: any.",
    )
    aggregate = models.CharField(
        max_length=8,
        choices=Aggregate.choices,
        default=Aggregate.AVG,
    )
    comparison = models.CharField(
        max_length=4,
        choices=Comparison.choices,
    )
    threshold = models.FloatField()
    window_s = models.PositiveIntegerField(
        default=300,
        validators=[MinValueValidator(10), MaxValueValidator(7 * 86400)],
        help_text="Samples of the last window_s seconds are aggregated.",
    )
    summary = models.CharField(
        max_length=300,
        blank=True,
    )
    enabled = models.BooleanField(
        default=True,
    )

    class Meta:
        ordering = ["layer", "name"]

    def __str__(self) -> str:
        return self.name


class Alert(models.Model):
    """One breach of one rule by one subject, from firing to resolved. At most one firing
    alert per rule and subject (deduplication); once resolved it stays as history."""

    rule = models.ForeignKey(
        "alerts.AlertRule",
        on_delete=models.CASCADE,
        related_name="alerts",
    )
    rule_name = models.CharField(
        max_length=63,
    )
    level = models.CharField(
        max_length=16,
        choices=AlertLevel.choices,
    )
    layer = models.CharField(
        max_length=16,
        choices=AlertLayer.choices,
    )
    subject_type = models.CharField(
        max_length=100,
    )
    subject_id = models.CharField(
        max_length=64,
    )
    state = models.CharField(
        max_length=16,
        choices=AlertState.choices,
        default=AlertState.FIRING,
        db_index=True,
    )
    value = models.FloatField(
        help_text="The aggregated value at the last evaluation that breached.",
    )
    threshold = models.FloatField()
    message = models.CharField(
        max_length=500,
    )
    started_at = models.DateTimeField(
        db_index=True,
    )
    last_seen_at = models.DateTimeField()
    resolved_at = models.DateTimeField(
        null=True,
        blank=True,
    )
    notifications = models.JSONField(
        default=list,
        blank=True,
        help_text="Deliveries: [{channel, event, ok, detail, at}].",
    )
    acknowledged_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When someone took the alert on (it keeps firing until its condition ends).",
    )
    acknowledged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    acknowledged_note = models.CharField(
        max_length=300,
        blank=True,
        help_text="What the person acknowledging said (a ticket, who is on it).",
    )

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["rule", "subject_type", "subject_id"],
                condition=models.Q(state="firing"),
                name="alert_one_firing_per_rule_subject",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.rule_name} {self.subject_type}:{self.subject_id} ({self.state})"


class NotificationChannel(Timestamped):
    """Where alerts are sent: a webhook URL or e-mail addresses, from ``min_level`` up."""

    name = models.CharField(
        max_length=63,
        unique=True,
        validators=[name_validator],
    )
    kind = models.CharField(
        max_length=16,
        choices=ChannelKind.choices,
    )
    target = models.CharField(
        max_length=1000,
        help_text="Webhook: an http(s) URL. E-mail: comma-separated addresses.",
    )
    min_level = models.CharField(
        max_length=16,
        choices=AlertLevel.choices,
        default=AlertLevel.WARNING,
    )
    send_resolved = models.BooleanField(
        default=True,
        help_text="Also notify when an alert resolves.",
    )
    enabled = models.BooleanField(
        default=True,
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
