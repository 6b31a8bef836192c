"""Beat jobs that keep the inventory and telemetry honest: node liveness and sample retention."""

from __future__ import annotations

from typing import Any

from orchestrator.celery import app


@app.task(
    name="orchestrator.inventory.mark_missing", acks_late=True, soft_time_limit=30, time_limit=45
)
def mark_missing_nodes() -> dict[str, list[int]]:
    """Every few seconds: nodes whose heartbeats stopped become degraded, then lost (never
    de-escalated here; only a heartbeat does that) -- unless the console itself could not hear
    them (its listener's probe fails, or this loop had stopped): see
    :mod:`console.inventory.liveness`."""
    from console.inventory.liveness import liveness_check

    return liveness_check().changed


@app.task(
    name="orchestrator.inventory.reconcile", acks_late=True, soft_time_limit=540, time_limit=600
)
def reconcile_engines() -> dict[int, dict[str, Any]]:
    """Every ``RECONCILE_S``: each active deployment's desired children against its nodes'
    heartbeats; a missing one is launched again (``orchestrator.reconcile``). A launch waits
    for the engine's readiness, hence the time limit; a tick that overlaps a running one
    finds the child reported (starting) and leaves it."""
    from orchestrator.reconcile import reconcile_all

    return reconcile_all()


@app.task(
    name="orchestrator.telemetry.prune_samples", acks_late=True, soft_time_limit=300, time_limit=330
)
def prune_samples() -> int:
    """Hourly: delete telemetry samples older than ``PDBRIDGE_TELEMETRY_RETENTION_DAYS``."""
    from datetime import timedelta

    from django.conf import settings

    from console.telemetry.services import samples_prune

    return samples_prune(older_than=timedelta(days=settings.TELEMETRY_RETENTION_DAYS))


@app.task(
    name="orchestrator.telemetry.collect_gateways",
    acks_late=True,
    soft_time_limit=60,
    time_limit=75,
)
def collect_gateways() -> dict[str, int]:
    """Every ``GATEWAY_SCRAPE_S``: scrape each serving deployment's gateways into telemetry
    samples (path mix, TTFT, success ratio, link utilisation); see ``orchestrator.telemetryops``."""
    from orchestrator import telemetryops

    return telemetryops.collect()


@app.task(
    name="orchestrator.telemetry.probe_links",
    acks_late=True,
    soft_time_limit=120,
    time_limit=150,
)
def probe_links() -> dict[str, Any]:
    """Every ``LINK_PROBE_S``: a short bandwidth / RTT probe of each link a serving deployment
    uses (skipped during its drills and while the link is at its ceiling); see
    ``orchestrator.linkops``."""
    from orchestrator import linkops

    return linkops.probe_all()
