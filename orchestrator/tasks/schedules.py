"""Beat jobs of the slow control loops: the tidal schedule's hourly plan and rebalancing
proposals. Thin: the console services re-check the world and are idempotent per hour."""

from __future__ import annotations

from orchestrator.celery import app


@app.task(
    name="orchestrator.schedules.apply_tidal", acks_late=True, soft_time_limit=120, time_limit=150
)
def apply_tidal() -> list[int]:
    """Every minute: apply the current hour of every enabled tidal schedule (a no-op for an
    hour already applied; a skipped hour is re-tried once the kill switch or canary clears)."""
    from console.schedules.services import tidal_apply_due

    return tidal_apply_due()


@app.task(
    name="orchestrator.schedules.propose_rebalance",
    acks_late=True,
    soft_time_limit=120,
    time_limit=150,
)
def propose_rebalance() -> list[int]:
    """Hourly: compare producer and consumer throughput with the planner's split; propose
    (or, where enabled, apply) converting local nodes between prefill and decode."""
    from console.schedules.rebalance import rebalance_due

    return rebalance_due()
