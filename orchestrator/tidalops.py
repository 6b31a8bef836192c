"""Carries out a tidal hour's scale intent on the agents: Launch the deployment's prefill engine
on the remote nodes that should run this hour, Stop it on those that should not.

Called by the beat job ``orchestrator.schedules.apply_tidal`` (inside a Celery worker) right
after ``console.schedules.services.tidal_apply_due`` has written the hour's
``TidalApplication`` row with its intent (``scale.run`` / ``scale.stop``). The console never
calls agents; this module is the only place the tidal schedule touches them.

Blocking (agent calls over mTLS through :mod:`orchestrator.agentops`). Failures never escape:
a node that cannot be reached or refuses is recorded on the row (``scale.agents`` per node,
``error`` summarised, ``scale.agents_state = "failed"``) and the next tick of the same hour
tries again with the *same* request ids, so an agent that already acted answers from its
request-id cache (or finds the same child with the same spec: ``unchanged``). An hour whose
calls all succeeded is ``done`` and later ticks leave the agents alone. The kill switch and a
canary in progress are re-checked here (they may have started after the row was written):
then no agent is touched and the row says ``deferred``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from django.db import transaction

from console.deployments.config import build_config
from console.deployments.models import Deployment
from console.inventory.choices import NodeStatus
from console.inventory.models import Node
from console.schedules.choices import FINAL_OUTCOMES
from console.schedules.models import TidalApplication
from console.schedules.services import canary_in_progress
from orchestrator import agentops
from orchestrator.agentops import Target

logger = logging.getLogger(__name__)

KIND = "prefill-engine"
DONE = "done"
FAILED = "failed"
DEFERRED = "deferred"


def tidal_request_id(row: TidalApplication, action: str, target: Target, body: Any) -> str:
    """Stable per (application row, action, node, settings): a tick that repeats an hour's
    calls sends the same request ids, so the agents answer instead of acting twice."""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    return f"tidal{row.pk}-{action}-{target.hostname}-{digest[:16]}"


def _launch(row: TidalApplication, target: Target, config: dict[str, Any], name: str) -> Any:
    # Same kind, name, settings and deployment id as the deployment workflow's remote_prefill
    # step, so a running engine launched by the workflow is found ``unchanged``, not replaced.
    engine, settings = agentops.engine_launch_settings(target, config)
    rid = tidal_request_id(row, "launch", target, {"engine": engine, "settings": settings})
    result = agentops.launch(
        target,
        kind=KIND,
        name=name,
        engine=engine,
        launch_settings=settings,
        deployment_id=row.schedule.deployment_id,
        rid=rid,
    )
    if result["state"] != "running":
        result["error"] = f"{name} is {result['state']} after launch"
    return result


def _stop(row: TidalApplication, target: Target, name: str) -> dict[str, Any]:
    current = agentops.child_status(target, name)
    if current["state"] == "absent":
        return {"node": target.hostname, "name": name, "action": "absent"}
    rid = tidal_request_id(row, "stop", target, name)

    async def go(agent: Any) -> Any:
        return await agent.stop(name, request_id=rid)

    answer = agentops.call(target, go)
    return {
        "node": target.hostname,
        "name": name,
        "action": "stopped",
        "state": answer.child.state,
        "request_id": rid,
    }


def _act(row: TidalApplication, deployment: Deployment) -> tuple[list[dict[str, Any]], list[str]]:
    """One call per node of the intent; returns (per-node results, errors)."""
    scale = row.scale
    config = build_config(deployment)
    site = row.schedule.remote_site.name
    by_host = {t.hostname: t for t in agentops.targets(config, "prefill") if t.site == site}
    lost = set(
        Node.objects.filter(hostname__in=scale.get("stop", []), status=NodeStatus.LOST).values_list(
            "hostname", flat=True
        )
    )
    name = agentops.child_name(deployment.pk, "prefill")
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    plan = [("launch", h) for h in scale.get("run", [])] + [
        ("stop", h) for h in scale.get("stop", [])
    ]
    for action, host in plan:
        target = by_host.get(host)
        if target is None:
            # The pool changed since the row was written; the next hour's intent follows it.
            results.append({"node": host, "action": "skipped", "why": "not in the pool now"})
            continue
        if action == "stop" and host in lost:
            results.append({"node": host, "action": "skipped", "why": "node lost"})
            continue
        try:
            result = (
                _launch(row, target, config, name)
                if action == "launch"
                else _stop(row, target, name)
            )
        except Exception as exc:  # any agent failure is recorded, never raised to the beat
            message = str(getattr(exc, "details", lambda: None)() or exc)[:500]
            result = {"node": host, "action": action, "error": message}
        if result.get("error"):
            errors.append(f"{action} {host}: {result['error']}")
        results.append(result)
    return results, errors


def carry_out(application_id: int) -> str:
    """Carry out one application row's scale intent (see module docstring). Returns the
    row's agents state (``done``, ``failed``, ``deferred``) or ``""`` when there is nothing
    to do (not a final outcome, no intent, already done, or another tick holds the row)."""
    with transaction.atomic():
        row = (
            TidalApplication.objects.select_for_update(skip_locked=True)
            .select_related("schedule", "schedule__remote_site")
            .filter(pk=application_id)
            .first()
        )
        if row is None or row.outcome not in FINAL_OUTCOMES or "run" not in row.scale:
            return ""
        if row.scale.get("agents_state") == DONE:
            return ""
        deployment = Deployment.objects.select_related("model").get(pk=row.schedule.deployment_id)
        scale = dict(row.scale)
        if deployment.kill_switch or canary_in_progress(deployment) is not None:
            scale["agents_state"] = DEFERRED
            scale["agent_calls"] = "deferred: kill switch on or canary in progress"
            row.scale = scale
            row.save(update_fields=["scale"])
            return DEFERRED
        try:
            results, errors = _act(row, deployment)
        except agentops.AgentOpsError as exc:
            results, errors = [], [str(exc)]
        state = FAILED if errors else DONE
        scale["agents"] = results
        scale["agents_state"] = state
        scale["agent_calls"] = (
            f"{len(results)} node(s) called" if not errors else f"failed: {len(errors)} error(s)"
        )
        scale["agent_attempts"] = int(scale.get("agent_attempts", 0)) + 1
        row.scale = scale
        row.error = "; ".join(errors)[:2000]
        row.save(update_fields=["scale", "error"])
    log = logger.warning if errors else logger.info
    log(
        "tidal_agents",
        extra={
            "application": row.pk,
            "state": state,
            "run": scale.get("run"),
            "stop": scale.get("stop"),
            "errors": len(errors),
        },
    )
    return state


def carry_out_all(application_ids: list[int]) -> dict[int, str]:
    """Beat entry point: ``carry_out`` each row; one row's unexpected failure is logged and
    does not stop the others."""
    out: dict[int, str] = {}
    for pk in application_ids:
        try:
            out[pk] = carry_out(pk)
        except Exception:  # the beat job must keep running for the other schedules
            logger.exception("tidal_agents_error", extra={"application": pk})
            out[pk] = "error"
    return out
