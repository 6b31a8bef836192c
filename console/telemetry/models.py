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
