"""Carries out a tidal hour's scale intent on the agents and the gateways' pools: Launch the
deployment's prefill engine on the remote nodes that should run this hour, Stop it on those that
should not -- a node leaving is drained from the gateways first, a node joining is put back once
its engine is healthy.

Called by the beat job ``orchestrator.schedules.apply_tidal`` (inside a Celery worker) right
after ``console.schedules.services.tidal_apply_due`` has written the hour's
``TidalApplication`` row with its intent (``scale.run`` / ``scale.stop``), and by its re-check
task ``orchestrator.schedules.carry_out_tidal`` while a drain is waiting. The console never
calls agents; this module is the only place the tidal schedule touches them.

One call of :func:`carry_out` is one short step of the hour, never a sleep:

1. **launch** each node of ``run`` (same request ids on every tick); a launched engine whose
   agent reports it ``healthy`` rejoins the pool;
2. **drain**: the nodes of ``stop`` are marked ``drained`` in the pool, and with the rejoined
   ones this writes one new config version (``console.deployments.services.pool_set_drained``);
   A higher share that ``tidal_apply_hour`` held back because no node of ``run`` was in
   rotation (``scale.share``, ``waiting``) is published once every decode gateway applied the
   rejoin version and shows the joined instances available (re-checked like a drain;
   ``TIDAL_DRAIN_TIMEOUT_S`` at most): traffic goes to an instance only once it serves;
3. **wait** (re-checked, the row says ``draining``): every decode gateway of the deployment
   must report that version applied (``pdbridge_gateway_config_version``) and no leg in flight
   to the nodes leaving (``pdbridge_gateway_instance_in_flight``), or
   ``settings.TIDAL_DRAIN_TIMEOUT_S`` has passed since the drain (recorded as timed out);
4. **stop** each engine of ``stop`` (after a ``Status``: an absent child is not called).

Everything is evidence on the row (``scale.agents`` per node with the time of each call,
``scale.drain`` with the version, the gateways' answers and when they all applied it).
Blocking (agent calls over mTLS through :mod:`orchestrator.agentops`, gateway scrapes with a
deadline). Failures never escape: a node that cannot be reached or refuses is recorded on the
row (``error`` summarised, ``scale.agents_state = "failed"``) and the next tick of the same hour
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
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from console.deployments.config import build_config
from console.deployments.models import Deployment, Pool
from console.deployments.services import deployment_update, pool_set_drained
from console.inventory.choices import NodeStatus
from console.inventory.models import Node
from console.schedules.choices import FINAL_OUTCOMES
from console.schedules.models import TidalApplication
from console.schedules.services import canary_in_progress
from orchestrator import agentops
from orchestrator.agentops import Target
from orchestrator.workflows import gateway_metrics as gm

logger = logging.getLogger(__name__)

KIND = "prefill-engine"
DONE = "done"
FAILED = "failed"
DEFERRED = "deferred"
#: A drain is waiting for the gateways (re-checked every RECHECK_S by carry_out_tidal).
DRAINING = "draining"
RECHECK_S = 2.0
SCRAPE_TIMEOUT_S = 5.0


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
        "at": _iso(timezone.now()),
    }


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds")


def _gateway_pages(config: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None, str]]:
    """Each decode gateway of the deployment: (url, its parsed metrics page or None, the
    scrape's error)."""
    ssl_ctx = agentops.http_ssl_context()
    pages: list[tuple[str, dict[str, Any] | None, str]] = []
    for target in agentops.targets(config, "decode"):
        url = agentops.gateway_url(target)
        try:
            pages.append((url, agentops.run_async(gm.scrape(url, ssl_ctx, SCRAPE_TIMEOUT_S)), ""))
        except Exception as exc:  # unreachable: judged as not there yet (timeouts bound it)
            pages.append((url, None, repr(exc)[:300]))
    return pages


def gateways_drained(
    config: dict[str, Any], site: str, hosts: list[str], version: int, role: str = "prefill"
) -> tuple[bool, list[dict[str, Any]]]:
    """Whether every decode gateway of the deployment applied ``version`` and has no
    ``role`` leg in flight to ``hosts`` at ``site``; with each gateway's answer (evidence). A
    gateway that does not answer has not applied it. Also the rebalance workflow's drain."""
    answers: list[dict[str, Any]] = []
    for url, page, error in _gateway_pages(config):
        if page is None:
            answers.append({"gateway": url, "error": error, "applied": False})
            continue
        inflight = page["instance_in_flight"].get(role, {}).get(site, {})
        legs = sum(int(n) for u, n in inflight.items() if urlsplit(u).hostname in hosts)
        applied = (page["config_version"] or 0) >= version
        answers.append(
            {
                "gateway": url,
                "config_version": page["config_version"],
                "in_flight": legs,
                "applied": applied and legs == 0,
            }
        )
    return bool(answers) and all(a["applied"] for a in answers), answers


def gateways_serving(
    config: dict[str, Any], site: str, hosts: list[str], version: int
) -> tuple[bool, list[dict[str, Any]]]:
    """Whether every decode gateway of the deployment applied ``version`` and has the prefill
    instances on ``hosts`` at ``site`` in its pool and available (its own health probes found
    them serving); with each gateway's answer (evidence)."""
    answers: list[dict[str, Any]] = []
    for url, page, error in _gateway_pages(config):
        if page is None:
            answers.append({"gateway": url, "error": error, "serving": False})
            continue
        available = page["instance_available"].get("prefill", {}).get(site, {})
        up = sorted(urlsplit(u).hostname or "" for u, n in available.items() if n >= 1)
        applied = (page["config_version"] or 0) >= version
        answers.append(
            {
                "gateway": url,
                "config_version": page["config_version"],
                "available": up,
                "serving": applied and all(h in up for h in hosts),
            }
        )
    return bool(answers) and all(a["serving"] for a in answers), answers


def _publish_share(
    row: TidalApplication, deployment: Deployment, config: dict[str, Any], scale: dict[str, Any]
) -> bool:
    """The hour's share held back by ``tidal_apply_hour`` (``scale.share``, state ``waiting``)
    goes out once the engines that joined are in every gateway's pool and available (or
    ``TIDAL_DRAIN_TIMEOUT_S`` after they joined: recorded ``timed_out``). Returns whether it
    is still waiting."""
    share = dict(scale.get("share") or {})
    joined = scale.get("joined")
    if share.get("state") != "waiting" or not joined:
        return False  # nothing held, or no engine joined yet (the next tick launches again)
    site = row.schedule.remote_site.name
    ok, answers = gateways_serving(config, site, joined["nodes"], int(joined["version"]))
    share["gateways"] = answers
    share["checks"] = int(share.get("checks", 0)) + 1
    share.setdefault("joined_at", _iso(timezone.now()))
    waited = timezone.now() - datetime.fromisoformat(share["joined_at"])
    timed_out = waited.total_seconds() >= float(settings.TIDAL_DRAIN_TIMEOUT_S)
    if not ok and not timed_out:
        scale["share"] = share
        return True
    if deployment.kill_switch or canary_in_progress(deployment) is not None:
        share["state"] = "skipped"  # an operator's switch or a canary owns the share now
    else:
        updated = deployment_update(
            actor=None,
            deployment=deployment,
            reason=f"tidal {row.hour:02d}:00: share once {', '.join(joined['nodes'])} serve",
            remote_share_percent=share["percent"],
        )
        share.update(
            state="published" if ok else "timed_out",
            version=updated.version,
            published_at=_iso(timezone.now()),
        )
    scale["share"] = share
    return False


def _step(
    row: TidalApplication, deployment: Deployment, scale: dict[str, Any]
) -> tuple[str, list[str]]:
    """One step of the hour (see the module docstring); updates ``scale`` in place and
    returns (agents state, errors)."""
    config = build_config(deployment)
    site = row.schedule.remote_site.name
    by_host = {t.hostname: t for t in agentops.targets(config, "prefill") if t.site == site}
    pool = Pool.objects.filter(pk=scale.get("pool")).first()
    lost = set(
        Node.objects.filter(hostname__in=scale.get("stop", []), status=NodeStatus.LOST).values_list(
            "hostname", flat=True
        )
    )
    name = agentops.child_name(deployment.pk, "prefill")
    done = {r["node"]: r for r in scale.get("agents", []) if not r.get("error")}
    results: dict[str, dict[str, Any]] = {}
    errors: list[str] = []

    def attempt(action: str, host: str, target: Target) -> None:
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
        results[host] = result

    # 1. launch; a healthy engine rejoins the pool.
    joined: list[str] = []
    for host in scale.get("run", []):
        target = by_host.get(host)
        if target is None:
            # The pool changed since the row was written; the next hour's intent follows it.
            results[host] = {"node": host, "action": "skipped", "why": "not in the pool now"}
            continue
        if host in done:
            results[host] = done[host]
        else:
            attempt("launch", host, target)
        if not results[host].get("error"):
            status = agentops.child_status(target, name)
            results[host]["healthy"] = status["healthy"]
            if status["healthy"]:
                joined.append(host)
            else:
                errors.append(f"launch {host}: {name} is not healthy yet")
    # 2. drain the nodes leaving (and put back the ones that joined): one config version.
    leaving = [h for h in scale.get("stop", []) if h in by_host]
    drain = dict(scale.get("drain") or {})
    if pool is not None:
        nodes = {n.hostname: n for n in pool.nodes.all()}
        drained_now = set(pool.drained_nodes.values_list("hostname", flat=True))
        to_drain = [nodes[h] for h in leaving if h in nodes and h not in drained_now]
        to_join = [nodes[h] for h in joined if h in nodes and h in drained_now]
        if to_drain or to_join:
            version = pool_set_drained(
                actor=None,
                pool=pool,
                drain=to_drain,
                rejoin=to_join,
                reason=f"tidal {row.hour:02d}:00: drain {len(to_drain)}, rejoin {len(to_join)}",
            )
            if to_join:
                scale["joined"] = {"version": version, "nodes": [n.hostname for n in to_join]}
            if to_drain:
                drain = {
                    "version": version,
                    "nodes": leaving,
                    "started_at": _iso(timezone.now()),
                    "state": "waiting",
                }
    # 2b. a share held for this scale-up goes out once the joined engines serve.
    if _publish_share(row, deployment, config, scale):
        scale["drain"] = drain
        scale["agents"] = list({**done, **results}.values())
        return DRAINING, errors
    # 3. wait for the gateways (re-checked by the caller, never slept on here).
    to_stop = [h for h in leaving if h not in done]
    timeout_s = float(settings.TIDAL_DRAIN_TIMEOUT_S)
    if to_stop and drain.get("state") == "waiting" and drain.get("checks") is None and timeout_s:
        # Written in this step's transaction: no gateway can have it before it commits.
        drain["checks"] = 0
        scale["drain"] = drain
        scale["agents"] = list({**done, **results}.values())
        return DRAINING, errors
    if to_stop and drain.get("state") == "waiting":
        ok, answers = gateways_drained(config, site, to_stop, int(drain["version"]))
        drain["gateways"] = answers
        drain["checks"] = int(drain.get("checks", 0)) + 1
        waited = timezone.now() - datetime.fromisoformat(drain["started_at"])
        if ok:
            drain["state"] = "applied"
            drain["applied_at"] = _iso(timezone.now())
        elif waited.total_seconds() >= timeout_s:
            drain["state"] = "timed_out"
            drain["applied_at"] = _iso(timezone.now())
        else:
            scale["drain"] = drain
            scale["agents"] = list({**done, **results}.values())
            return DRAINING, errors
    scale["drain"] = drain
    # 4. stop.
    for host in scale.get("stop", []):
        target = by_host.get(host)
        if target is None:
            results[host] = {"node": host, "action": "skipped", "why": "not in the pool now"}
        elif host in lost:
            results[host] = {"node": host, "action": "skipped", "why": "node lost"}
        elif host in done:
            results[host] = done[host]
        else:
            attempt("stop", host, target)
    scale["agents"] = list(results.values())
    return (FAILED if errors else DONE), errors


def carry_out(application_id: int) -> str:
    """Carry out one step of an application row's scale intent (see module docstring).
    Returns the row's agents state (``done``, ``draining``: call again in ``RECHECK_S``,
    ``failed``, ``deferred``) or ``""`` when there is nothing to do (not a final outcome, no
    intent, already done, or another tick holds the row)."""
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
            state, errors = _step(row, deployment, scale)
        except agentops.AgentOpsError as exc:
            state, errors = FAILED, [str(exc)]
        scale["agents_state"] = state
        calls = len(scale.get("agents", []))
        scale["agent_calls"] = {
            DONE: f"{calls} node(s) called",
            DRAINING: "waiting for the gateways to apply the drain or serve the joined engines",
        }.get(state, f"failed: {len(errors)} error(s)")
        if row.scale.get("agents_state") != DRAINING:  # re-checks of a drain are one attempt
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
            "drain": (scale.get("drain") or {}).get("state"),
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
