"""Beat job: evaluate the alert rules over the telemetry series and notify."""

from __future__ import annotations

from typing import Any

from orchestrator.celery import app


@app.task(name="orchestrator.alerts.evaluate", acks_late=True, soft_time_limit=90, time_limit=120)
def evaluate_alerts() -> dict[str, Any]:
    """Every minute: open, refresh or resolve alerts (deduplicated), then deliver webhooks
    and e-mail for what changed. Safe to run twice: a firing alert is never duplicated."""
    from console.alerts.services import alerts_evaluate

    return alerts_evaluate()
