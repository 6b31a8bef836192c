"""Thin drill tasks: the beat entry that starts a scheduled drill."""

from __future__ import annotations

import logging
from typing import Any

from orchestrator.celery import app

log = logging.getLogger("pdbridge.orchestrator")


@app.task(name="orchestrator.drills.run_scheduled", acks_late=True, soft_time_limit=60)
def run_scheduled(drill_id: int) -> dict[str, Any]:
    """Beat job (one ``PeriodicTask`` per scheduled drill): start the drill now. A drill already
    running on the deployment, or a drill deleted meanwhile, is skipped and logged."""
    from console.core.api.exceptions import Conflict
    from console.drills import services
    from console.drills.models import Drill

    drill = Drill.objects.filter(pk=drill_id).first()
    if drill is None:
        log.warning("drill.scheduled_missing drill=%s", drill_id)
        return {"drill": drill_id, "outcome": "missing"}
    try:
        report = services.drill_run(actor=None, drill=drill, trigger="schedule")
    except Conflict as exc:
        log.warning("drill.scheduled_skipped drill=%s reason=%s", drill_id, exc)
        return {"drill": drill_id, "outcome": "skipped", "reason": str(exc)}
    return {"drill": drill_id, "outcome": "started", "report": report.pk, "run": report.run_id}
