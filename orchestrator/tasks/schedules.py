"""Beat jobs of the slow control loops: the tidal schedule's hourly plan and rebalancing
proposals. Thin: the console services re-check the world and are idempotent per hour."""

from __future__ import annotations

from orchestrator.celery import app


# Launches wait for engine readiness (the agent's readiness timeout): allow a few minutes; an
# overlapping tick skips rows the running one holds (``carry_out`` locks with skip_locked).
@app.task(
    name="orchestrator.schedules.apply_tidal", acks_late=True, soft_time_limit=540, time_limit=600
)
def apply_tidal() -> list[int]:
    """Every minute: apply the current hour of every enabled tidal schedule (a no-op for an
    hour already applied; a skipped hour is re-tried once the kill switch or canary clears),
    then carry out the hour's scale intent on the remote agents (Launch / Stop of the
    deployment's prefill engine, once per hour; failed calls re-tried on the next tick)."""
    from console.schedules.services import tidal_apply_due
    from orchestrator.tidalops import DRAINING, RECHECK_S, carry_out_all

    ids = tidal_apply_due()
    for pk, state in carry_out_all(ids).items():
        if state == DRAINING:
            carry_out_tidal.apply_async((pk,), countdown=RECHECK_S)
    return ids


@app.task(
    name="orchestrator.schedules.carry_out_tidal",
    acks_late=True,
    soft_time_limit=540,
    time_limit=600,
)
def carry_out_tidal(application_id: int) -> str:
    """Re-check of one tidal hour whose drain waits for the gateways (sent with a countdown,
    never a sleeping worker): one step of ``orchestrator.tidalops.carry_out``; sent again while
    it still waits. A lost message costs at most a minute: the beat's next tick re-checks."""
    from orchestrator.tidalops import DRAINING, RECHECK_S, carry_out

    state = carry_out(application_id)
    if state == DRAINING:
        carry_out_tidal.apply_async((application_id,), countdown=RECHECK_S)
    return state


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
