from django.db import models


class RunState(models.TextChoices):
    """A run's life: pending -> running -> succeeded | failed | canceled | rolled_back."""

    # Created; its first step has not started.
    PENDING = "pending", "Pending"
    # A step is executing or waiting for its next re-check.
    RUNNING = "running", "Running"
    # Every step succeeded.
    SUCCEEDED = "succeeded", "Succeeded"
    # A step failed; the run stopped at it and can be retried from it.
    FAILED = "failed", "Failed"
    # An operator canceled it.
    CANCELED = "canceled", "Canceled"
    # A gate failed and the workflow undid its change (canary back to 0 %).
    ROLLED_BACK = "rolled_back", "Rolled back"


RUN_TERMINAL = {RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELED, RunState.ROLLED_BACK}


class StepState(models.TextChoices):
    """A step's life: pending -> running -> succeeded | failed | canceled | skipped."""

    # Not reached yet.
    PENDING = "pending", "Pending"
    # Claimed by a worker (its heartbeat shows it is alive) or waiting for a re-check.
    RUNNING = "running", "Running"
    # Done; its evidence is recorded.
    SUCCEEDED = "succeeded", "Succeeded"
    # Its check failed or it raised; the error is recorded.
    FAILED = "failed", "Failed"
    # The run was canceled before or while it ran.
    CANCELED = "canceled", "Canceled"
    # The workflow decided it does not apply.
    SKIPPED = "skipped", "Skipped"
