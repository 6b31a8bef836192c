"""Reconcile: what each active deployment says should run on each of its nodes (desired
state, from the database) against what the nodes' heartbeats report (observed state), in the
manner of a Kubernetes controller. A child the deployment needs and the node does not report
at all -- its agent restarted (the keeper takes an agent's children down with it) or it was
stopped behind the control plane's back -- is launched again through the node's agent, with
the deploy workflow's own settings (found ``unchanged`` if it is there after all). Every
difference is recorded: an audit entry per relaunch, a log line, and the sample
``deployment_engines_missing`` per deployment that the shipped alert rule ``engines-missing``
fires on; ``console.deployments.selectors.engine_drift`` shows it on the deployment (API).

Desired, per active deployment: ``console.deployments.config.wanted_children``. A node is
judged only when it is ``online`` (a fresh heartbeat says what runs there) and has no fault
injected (a drill owns its engines then); a child the agent reports in any state (starting,
backoff, held, failed) is the agent's to handle and is never launched over.

Called by the beat job ``orchestrator.inventory.reconcile`` (every ``RECONCILE_S``) inside a
Celery worker; blocking (agent calls over mTLS, a launch waits for the engine's readiness).
Failures never escape: a node that cannot be reached or refuses is recorded and tried again
on the next tick.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from console.core.models import AuditLog
from console.deployments.choices import DeploymentState
from console.deployments.config import build_config, wanted_children
from console.deployments.models import Deployment
from console.deployments.selectors import reported_children
from console.deployments.services import deployment_engine_relaunched
from console.inventory.choices import NodeStatus
from console.inventory.models import Node
from console.telemetry.names import DEPLOYMENT_ENGINES_MISSING
from console.telemetry.services import samples_record_many
from orchestrator import agentops
from orchestrator.agentops import Target

logger = logging.getLogger("pdbridge.orchestrator")


def _settings(target: Target, part: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The engine and launch settings the deploy workflow uses for this part."""
    if part == "gateway":
        return "", agentops.gateway_launch_settings(target)
    if part == "kvlink":
        return "", agentops.kv_link_launch_settings(target, config)
    return agentops.engine_launch_settings(target, config)


def _relaunch(
    deployment: Deployment, config: dict[str, Any], target: Target, want: dict[str, Any], rid: str
) -> dict[str, Any]:
    """Launch one missing child with the deploy workflow's settings."""
    engine, settings = _settings(target, want["part"], config)
    return agentops.launch(
        target,
        kind=want["kind"],
        name=want["child"],
        engine=engine,
        launch_settings=settings,
        deployment_id=deployment.pk,
        rid=rid,
    )


def _request_id(deployment: Deployment, want: dict[str, Any], node: Node) -> str:
    """Names the heartbeat that reported the child missing: ticks until the next heartbeat
    repeat the request (and are skipped, :func:`_relaunched`), a later loss sends a new one."""
    since = node.last_heartbeat_at.isoformat() if node.last_heartbeat_at else ""
    digest = hashlib.sha256(f"{want['child']}|{since}".encode()).hexdigest()[:16]
    return f"reconcile-{deployment.pk}-{want['site']}-{want['node']}-{want['child']}-{digest}"


def _relaunched(deployment: Deployment, rid: str) -> bool:
    """Whether this heartbeat's loss was already acted on (its next heartbeat will say)."""
    return AuditLog.objects.filter(
        verb="engine_relaunch", object_id=str(deployment.pk), after__request_id=rid
    ).exists()


def reconcile_deployment(deployment: Deployment) -> dict[str, Any]:
    """One pass over one active deployment; returns what it found and did."""
    config = build_config(deployment)
    wanted = wanted_children(config)
    targets = {
        (t.role, t.site, t.hostname): t
        for role in ("decode", "prefill")
        for t in agentops.targets(config, role)
    }
    # By site and hostname: the loopback testbed's nodes are all "localhost".
    nodes = {
        (n.site.name, n.hostname): n
        for n in Node.objects.select_related("site").filter(
            hostname__in={w["node"] for w in wanted}
        )
    }
    missing: list[dict[str, Any]] = []
    actions: list[dict[str, Any]] = []
    for want in wanted:
        node, name = nodes.get((want["site"], want["node"])), want["child"]
        if node is None or node.status != NodeStatus.ONLINE:
            missing.append({"node": want["node"], "child": name, "why": "node not online"})
            continue
        if node.reported_faults:
            continue  # a drill's fault owns this node's engines now
        if name in reported_children(node):
            continue
        missing.append({"node": want["node"], "child": name, "why": "absent"})
        rid = _request_id(deployment, want, node)
        if _relaunched(deployment, rid):
            continue
        try:
            result = _relaunch(
                deployment, config, targets[(want["role"], want["site"], want["node"])], want, rid
            )
            action: dict[str, Any] = {"node": want["node"], "child": name, **result}
        except Exception as exc:  # recorded; the next tick tries again
            detail = getattr(exc, "details", None)
            message = str(detail() if callable(detail) else exc)[:500]
            action = {"node": want["node"], "child": name, "request_id": rid, "error": message}
        actions.append(action)
        if action.get("action") == "unchanged":
            continue  # it was there: the heartbeat that said otherwise is older than it
        deployment_engine_relaunched(deployment=deployment, evidence=action)
        log = logger.error if "error" in action else logger.warning
        log(
            "reconcile_relaunch",
            extra={"deployment": deployment.pk, "node": want["node"], "child": name,
                   "result": action.get("error") or action.get("action")},
        )  # fmt: skip
    samples_record_many(
        subject=deployment, values={DEPLOYMENT_ENGINES_MISSING: float(len(missing))}
    )
    return {"missing": missing, "actions": actions}


def reconcile_all() -> dict[int, dict[str, Any]]:
    """Beat entry point: every active deployment; one's failure is logged and does not stop
    the others."""
    out: dict[int, dict[str, Any]] = {}
    active = Deployment.objects.filter(state=DeploymentState.ACTIVE).select_related("model")
    for deployment in active:
        try:
            out[deployment.pk] = reconcile_deployment(deployment)
        except Exception:  # the beat job must keep running for the other deployments
            logger.exception("reconcile_error", extra={"deployment": deployment.pk})
            out[deployment.pk] = {"error": True}
    return out
