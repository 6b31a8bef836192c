"""Every queue and route in one place.

* ``pdbridge`` (default): control-plane work that may run on any worker.
* ``site.<name>``: work that must run near a site (probes, agent calls on that site's
  network); a worker in that datacenter consumes it (``-Q pdbridge,site.remote``).
"""

from __future__ import annotations

from typing import Any

from kombu import Queue

DEFAULT_QUEUE = "pdbridge"  # = settings.CELERY_TASK_DEFAULT_QUEUE


def site_queue(site_name: str) -> str:
    return f"site.{site_name}"


def task_queues() -> list[Queue]:
    return [Queue(DEFAULT_QUEUE)]


def route_task(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, str]:
    """Tasks with a ``site`` keyword go to that site's queue; everything else to the default."""
    site = (kwargs or {}).get("site")
    return {"queue": site_queue(site)} if site else {"queue": DEFAULT_QUEUE}


# Periodic jobs (also editable in the admin through django-celery-beat).
BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "resume-stalled-runs": {"task": "orchestrator.runs.resume_stalled", "schedule": 15.0},
    # Liveness is judged from heartbeat ages, so the period only bounds detection latency.
    "mark-missing-nodes": {"task": "orchestrator.inventory.mark_missing", "schedule": 10.0},
    # Desired children against heartbeats: an agent back after a restart gets its engines
    # again within a period plus a heartbeat (orchestrator.reconcile).
    "reconcile-engines": {"task": "orchestrator.inventory.reconcile", "schedule": 10.0},
    "prune-telemetry": {"task": "orchestrator.telemetry.prune_samples", "schedule": 3600.0},
    # The overview's path mix and the deployment charts are rates between two scrapes.
    "collect-gateways": {"task": "orchestrator.telemetry.collect_gateways", "schedule": 30.0},
    # Link telemetry: seconds of probe traffic per link every 5 minutes (PDBRIDGE_LINK_PROBE_S
    # is what staleness is judged against; keep it equal to this period).
    "probe-links": {"task": "orchestrator.telemetry.probe_links", "schedule": 300.0},
    "evaluate-alerts": {"task": "orchestrator.alerts.evaluate", "schedule": 60.0},
    # Idempotent per schedule-local hour: a minute's period applies a new hour within a minute.
    "apply-tidal": {"task": "orchestrator.schedules.apply_tidal", "schedule": 60.0},
    "propose-rebalance": {"task": "orchestrator.schedules.propose_rebalance", "schedule": 3600.0},
}
