from django.conf import settings
from django.db import models

from console.runs.choices import RunState, StepState


class WorkflowRun(models.Model):
    """One execution of a workflow (deploy, canary, drill ...) against a target object.

    Created and advanced only by ``console.runs.services``; Celery tasks execute steps but the
    rows here are the truth about what happened."""

    kind = models.CharField(
        max_length=64,
        db_index=True,
        help_text="Workflow name, a key of the orchestrator's workflow registry.",
    )
    target_type = models.CharField(
        max_length=100,
        blank=True,
        help_text="app_label.model of the object the run acts on.",
    )
    target_id = models.CharField(
        max_length=64,
        blank=True,
    )
    state = models.CharField(
        max_length=16,
        choices=RunState.choices,
        default=RunState.PENDING,
        db_index=True,
    )
    params = models.JSONField(
        default=dict,
        blank=True,
        help_text="Inputs of the run (small values only).",
    )
    result = models.JSONField(
        default=dict,
        blank=True,
        help_text="Summary the workflow wrote when it ended.",
    )
    error = models.TextField(
        blank=True,
    )
    cancel_requested = models.BooleanField(
        default=False,
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="workflow_runs",
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
        db_index=True,
    )
    started_at = models.DateTimeField(
        null=True,
        blank=True,
    )
    finished_at = models.DateTimeField(
        null=True,
        blank=True,
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["target_type", "target_id"], name="run_target_idx")]

    def __str__(self) -> str:
        return f"{self.kind} run #{self.pk} ({self.state})"


class StepRun(models.Model):
    """One step of a run, with the evidence that it did what it claims."""

    run = models.ForeignKey(
        "runs.WorkflowRun",
        on_delete=models.CASCADE,
        related_name="steps",
    )
    index = models.PositiveSmallIntegerField()
    name = models.CharField(
        max_length=64,
    )
    state = models.CharField(
        max_length=16,
        choices=StepState.choices,
        default=StepState.PENDING,
    )
    attempt = models.PositiveSmallIntegerField(
        default=0,
        help_text="How many times this step was started (retries and resumes included).",
    )
    evidence = models.JSONField(
        default=dict,
        blank=True,
        help_text="What the step measured or checked (probe results, verification table ...).",
    )
    log_excerpt = models.TextField(
        blank=True,
    )
    error = models.TextField(
        blank=True,
    )
    worker = models.CharField(
        max_length=200,
        blank=True,
        help_text="The worker that holds (or last held) the step.",
    )
    heartbeat_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Refreshed while a worker executes the step; a stale one means the worker died.",
    )
    wake_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When a waiting step is re-checked next.",
    )
    started_at = models.DateTimeField(
        null=True,
        blank=True,
    )
    finished_at = models.DateTimeField(
        null=True,
        blank=True,
    )

    class Meta:
        ordering = ["run", "index"]
        constraints = [
            models.UniqueConstraint(fields=["run", "index"], name="step_run_index_unique")
        ]

    def __str__(self) -> str:
        return f"step {self.index} {self.name} ({self.state})"
