from django.db import models


class MetricSample(models.Model):
    """One observation of a named metric about a subject (a node, link, deployment, site ...).

    Names use Prometheus conventions and base units (``link_measured_mbit_s``,
    ``gateway_ttft_p99_seconds``); ``labels`` carries small extra dimensions (``{"path": "remote"}``).
    """

    subject_type = models.CharField(
        max_length=100,
        help_text="app_label.model of the subject (inventory.node, deployments.deployment ...).",
    )
    subject_id = models.CharField(
        max_length=64,
    )
    name = models.CharField(
        max_length=100,
    )
    value = models.FloatField()
    labels = models.JSONField(
        default=dict,
        blank=True,
    )
    at = models.DateTimeField(
        db_index=True,
        help_text="When the value was observed (the observer's clock, corrected for known skew).",
    )

    class Meta:
        ordering = ["at", "id"]
        indexes = [
            models.Index(
                fields=["subject_type", "subject_id", "name", "at"], name="sample_series_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.subject_type}:{self.subject_id} {self.name}={self.value} @ {self.at:%Y-%m-%d %H:%M:%S}"


class RequestTrace(models.Model):
    """One request's path and timeline as a gateway recorded it (``pdproto.trace``), shipped
    by that gateway with its node token. ``started_at`` is on the console's clock: the
    gateway's wall clock minus its node's clock skew at ingestion (``skew_ms``); the legs are
    offsets from it on the gateway's monotonic clock, kept as sent in ``document``."""

    request_id = models.CharField(
        max_length=128,
        db_index=True,
        help_text="The gateway's x-request-id (clipped to 128 characters).",
    )
    node = models.ForeignKey(
        "inventory.Node",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="request_traces",
        help_text="The gateway's node (whose token shipped it).",
    )
    started_at = models.DateTimeField(
        db_index=True,
        help_text="Arrival at the gateway, on the console's clock (skew applied).",
    )
    path = models.CharField(
        max_length=16,
        blank=True,
        help_text="remote, local or fallback.",
    )
    outcome = models.CharField(
        max_length=32,
        blank=True,
    )
    total_ms = models.FloatField(
        null=True,
        blank=True,
        help_text="Arrival to the last byte relayed (ms).",
    )
    skew_ms = models.FloatField(
        null=True,
        blank=True,
        help_text="The gateway node's clock skew subtracted from its timestamp (ms).",
    )
    document = models.JSONField(
        default=dict,
        help_text="The trace as the gateway sent it.",
    )
    received_at = models.DateTimeField(
        auto_now_add=True,
        db_index=True,
    )

    class Meta:
        ordering = ["-started_at", "-id"]

    def __str__(self) -> str:
        return f"{self.request_id} {self.path} @ {self.started_at:%Y-%m-%d %H:%M:%S}"
