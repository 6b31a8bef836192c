"""Inventory writes: sites, nodes, links, node credentials, heartbeats and liveness.

Called by the API views, the admin and (for ``node_mark_missing``) the orchestrator's beat and
the ``node_mark_missing`` management command. All blocking, each in one transaction; bad input
raises Django ``ValidationError`` naming the field.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from console.core.api.exceptions import Conflict
from console.core.celery_client import nudge_on_commit
from console.core.choices import AuditAction
from console.core.crud import Actor, audited_create, audited_delete, audited_update
from console.core.services import audit_record
from console.inventory.choices import NodeStatus
from console.inventory.models import Link, Node, NodeCredential, Site
from console.telemetry import names
from console.telemetry.services import samples_record_many

logger = logging.getLogger(__name__)

# A late beat is not a missed one until half an interval has passed (network jitter).
HEARTBEAT_GRACE_INTERVALS = 0.5


def _refresh_deployments(
    *, actor: Actor, reason: str, sites: list[int] | None = None, nodes: list[int] | None = None
) -> None:
    # Deployments depend on inventory, not the other way round; import at call time so that
    # inventory stays importable on its own.
    from console.deployments.services import deployments_refresh

    deployments_refresh(actor=actor, reason=reason, site_ids=sites, node_ids=nodes)


@transaction.atomic
def site_create(*, actor: Actor, **fields: Any) -> Site:
    """Create a site."""
    return audited_create(actor=actor, model=Site, fields=fields)


# Pool roles a site role may host (mirrors console.deployments.services; kept as strings so
# inventory does not import deployments at module load).
_POOL_ROLES_FOR_SITE = {"decode": {"decode"}, "prefill": {"prefill"}, "both": {"decode", "prefill"}}


@transaction.atomic
def site_update(*, actor: Actor, site: Site, **fields: Any) -> Site:
    """Change a site; deployments with a pool there get a new config version if their config
    (which names the site) changes. A role that no longer fits its pools is a 400 on
    ``role``."""
    if "role" in fields and fields["role"] != site.role:
        allowed = _POOL_ROLES_FOR_SITE.get(fields["role"], set())
        misfits = sorted(set(site.pools.values_list("role", flat=True)) - allowed)
        if misfits:
            raise ValidationError(
                {"role": [f"Site {site.name} hosts {misfits[0]} pools; remove them first."]}
            )
    site, changed = audited_update(actor=actor, instance=site, fields=fields)
    if changed:
        _refresh_deployments(actor=actor, reason=f"site {site.name} changed", sites=[site.pk])
    return site


@transaction.atomic
def site_delete(*, actor: Actor, site: Site) -> None:
    """Delete a site with no nodes, links or pools (otherwise 409)."""
    audited_delete(actor=actor, instance=site)


@transaction.atomic
def node_create(*, actor: Actor, **fields: Any) -> Node:
    """Register a node; its status stays ``unknown`` until its first heartbeat."""
    return audited_create(actor=actor, model=Node, fields=fields)


@transaction.atomic
def node_update(*, actor: Actor, node: Node, **fields: Any) -> Node:
    """Change a node's registration (address, accelerators); liveness is not editable. A node
    in pools cannot move to another site (400 on ``site``)."""
    if "site" in fields and fields["site"] != node.site and node.pools.exists():
        raise ValidationError({"site": ["The node is in pools at its site; remove it first."]})
    node, changed = audited_update(actor=actor, instance=node, fields=fields)
    if changed:
        _refresh_deployments(actor=actor, reason=f"node {node.hostname} changed", nodes=[node.pk])
    return node


@transaction.atomic
def node_delete(*, actor: Actor, node: Node) -> None:
    """Delete a node (a pool still listing it keeps working without it; its config changes).
    Refused (409) while it serves a deploying or active deployment and is not drained from
    that pool: its engine would keep running, unwatched, and the pool could be left empty."""
    from console.deployments.choices import DeploymentState

    serving = [
        pool
        for pool in node.pools.select_related("deployment", "site")
        if pool.deployment.state in (DeploymentState.DEPLOYING, DeploymentState.ACTIVE)
        and not pool.drained_nodes.filter(pk=node.pk).exists()
    ]
    if serving:
        where = "; ".join(
            f"deployment {p.deployment.name} ({p.deployment.state}), {p.role} pool {p.pk} at "
            f"site {p.site.name}"
            for p in serving
        )
        raise Conflict(
            f"Node {node.hostname} serves {where}. Drain it from the pool first (POST "
            f"/api/pools/{serving[0].pk}/drain/ with drain: [{node.pk}]) so that no gateway "
            "sends it work, then delete it; or retire the deployment."
        )
    pool_sites = list(node.pools.values_list("site_id", flat=True))
    audited_delete(actor=actor, instance=node)
    if pool_sites:
        _refresh_deployments(actor=actor, reason=f"node {node.hostname} deleted", sites=pool_sites)


@transaction.atomic
def link_create(*, actor: Actor, **fields: Any) -> Link:
    """Create a link between two sites."""
    link = audited_create(actor=actor, model=Link, fields=fields)
    _refresh_deployments(
        actor=actor, reason=f"link {link} created", sites=[link.from_site_id, link.to_site_id]
    )
    return link


@transaction.atomic
def link_update(*, actor: Actor, link: Link, **fields: Any) -> Link:
    """Change a link (provisioned or measured rate, RTT, ceiling)."""
    old_sites = [link.from_site_id, link.to_site_id]
    link, changed = audited_update(actor=actor, instance=link, fields=fields)
    if changed:
        _refresh_deployments(
            actor=actor,
            reason=f"link {link} changed",
            sites=[*old_sites, link.from_site_id, link.to_site_id],
        )
    return link


@transaction.atomic
def link_delete(*, actor: Actor, link: Link) -> None:
    """Delete a link."""
    sites = [link.from_site_id, link.to_site_id]
    audited_delete(actor=actor, instance=link)
    _refresh_deployments(actor=actor, reason="link deleted", sites=sites)


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@transaction.atomic
def node_token_issue(*, actor: Actor, node: Node) -> str:
    """Issue a new bearer token for ``node``, replacing (and so revoking) any earlier one.
    Returns the token; only its hash is stored, so this is the one time it can be read."""
    token = "pdbn_" + secrets.token_urlsafe(32)
    existed = NodeCredential.objects.filter(node=node).delete()[0] > 0
    user = actor if actor is not None and actor.is_authenticated else None
    credential = NodeCredential.objects.create(
        node=node, token_hash=_token_hash(token), token_prefix=token[:8], created_by=user
    )
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="token_rotate" if existed else "token_issue",
        instance=node,
        after={"token_prefix": credential.token_prefix},
    )
    return token


def node_for_token(token: str) -> Node | None:
    """The node a bearer token belongs to, or None. Called by the API's node authentication
    on every agent request; one indexed lookup."""
    if not token:
        return None
    credential = (
        NodeCredential.objects.select_related("node", "node__site")
        .filter(token_hash=_token_hash(token))
        .first()
    )
    return credential.node if credential else None


@dataclass(frozen=True)
class HeartbeatResult:
    """What the heartbeat endpoint answers."""

    node: int
    status: str
    clock_skew_ms: float
    interval_s: int
    # Deployment id -> current config version, for every deployment with a pool holding this
    # node: which configs the agent should run (an addition to the agreed contract).
    deployments: dict[str, int]


@transaction.atomic
def node_heartbeat(
    *,
    node: Node,
    agent_version: str,
    clock: datetime,
    capacity: dict[str, Any],
    children: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    config_versions: dict[str, int],
    tls: dict[str, Any] | None = None,
    weights: list[dict[str, Any]] | None = None,
    agent_listen_host: str = "",
    agent_port: int | None = None,
    now: datetime | None = None,
) -> HeartbeatResult:
    """Record one heartbeat: the node is ``online``, its report replaces the previous one and
    its clock skew (node clock minus console clock, ms) is kept; the agent's control address
    follows what it reports (``agent_port``, and ``agent_listen_host`` unless a wildcard: an
    agent restarted on another port is reachable again at once). Called by the heartbeat
    endpoint. Status and address changes are audited; routine beats are not (one row per
    beat per node would drown the log)."""
    now = now or timezone.now()
    node = Node.objects.select_for_update().get(pk=node.pk)
    previous = node.status
    address = reported_agent_address(node.agent_address, agent_listen_host, agent_port)
    if address != node.agent_address:
        audit_record(
            actor=None,
            actor_label="heartbeat",
            action=AuditAction.UPDATE,
            verb="agent_address",
            instance=node,
            before={"agent_address": node.agent_address},
            after={"agent_address": address},
        )
        logger.warning(
            "node_agent_address_changed",
            extra={"node": node.pk, "from": node.agent_address, "to": address},
        )
        node.agent_address = address
    skew_ms = round((clock - now).total_seconds() * 1000.0, 3)
    gone = {str(c.get("name")) for c in node.reported_children or [] if isinstance(c, dict)}
    gone -= {str(c.get("name")) for c in children}
    if gone and node.pools.exists():
        # Children this node ran are gone (its agent restarted, or one was stopped behind the
        # control plane's back): the reconcile loop looks now rather than at its next tick.
        nudge_on_commit(RECONCILE_TASK)
    node.status = NodeStatus.ONLINE
    node.last_heartbeat_at = now
    node.agent_version = agent_version
    node.reported_capacity = capacity
    node.reported_children = children
    node.reported_faults = faults
    node.reported_config_versions = config_versions
    node.reported_tls = tls
    node.reported_weights = weights
    node.clock_skew_ms = skew_ms
    node.save()
    NodeCredential.objects.filter(node=node).update(last_used_at=now)
    # One history row per beat for the node page's charts (pruned by retention).
    samples_record_many(
        subject=node,
        values={
            names.NODE_CLOCK_SKEW_MS: skew_ms,
            names.NODE_CHILDREN_HEALTHY: sum(1 for c in children if c.get("healthy")),
            names.NODE_CHILDREN_TOTAL: len(children),
        },
        at=now,
    )
    if previous != NodeStatus.ONLINE:
        audit_record(
            actor=None,
            actor_label="heartbeat",
            action=AuditAction.ACTION,
            verb="node_status",
            instance=node,
            before={"status": previous},
            after={"status": NodeStatus.ONLINE},
        )
        logger.info(
            "node_status_changed", extra={"node": node.pk, "from": previous, "to": "online"}
        )
    return HeartbeatResult(
        node=node.pk,
        status=node.status,
        clock_skew_ms=skew_ms,
        interval_s=settings.HEARTBEAT_INTERVAL_S,
        deployments={
            str(pk): version
            for pk, version in node.pools.values_list("deployment_id", "deployment__version")
        },
    )


#: The reconcile loop's task (orchestrator.reconcile), sent by name.
RECONCILE_TASK = "orchestrator.inventory.reconcile"

_WILDCARDS = frozenset(("", "0.0.0.0", "::", "[::]"))  # noqa: S104 - recognised, not bound


def reported_agent_address(registered: str, listen_host: str, port: int | None) -> str:
    """The agent address a heartbeat reports: ``registered`` with the reported ``port``, and
    with the reported ``listen_host`` when it is a specific address (a wildcard listener is
    reached at the registered host). Unchanged without a port."""
    if port is None:
        return registered
    host = registered.rsplit(":", 1)[0] if ":" in registered else registered
    if listen_host not in _WILDCARDS:
        host = (
            f"[{listen_host}]"
            if ":" in listen_host and not listen_host.startswith("[")
            else listen_host
        )
    return f"{host}:{port}"


def missed_beats(*, last_heartbeat_at: datetime, now: datetime) -> int:
    """Heartbeat intervals missed since the last beat, allowing half an interval of lateness."""
    interval = settings.HEARTBEAT_INTERVAL_S
    age = (now - last_heartbeat_at).total_seconds()
    return max(0, math.floor(age / interval - HEARTBEAT_GRACE_INTERVALS))


@transaction.atomic
def node_mark_missing(
    *, now: datetime | None = None, blind_until: datetime | None = None
) -> dict[str, list[int]]:
    """Escalate nodes whose heartbeats stopped: ``online -> degraded`` after one missed
    interval, ``-> lost`` after ``HEARTBEAT_MISSED_LIMIT``. Never de-escalates (only a beat
    does). ``blind_until``: the end of the last window in which the console could not hear
    heartbeats (:func:`console.inventory.liveness.liveness_check` passes it); a node whose last
    beat is older is left alone until ``HEARTBEAT_OUTAGE_GRACE_S`` after it, for its silence
    may be the console's. Called by the liveness loop and the management command; ``now`` is
    injectable for tests. Returns the ids that changed, by new status."""
    now = now or timezone.now()
    interval = settings.HEARTBEAT_INTERVAL_S
    limit = settings.HEARTBEAT_MISSED_LIMIT
    grace_end = (
        blind_until + timezone.timedelta(seconds=settings.HEARTBEAT_OUTAGE_GRACE_S)
        if blind_until is not None
        else None
    )
    # Only nodes late by at least one interval can change: filter in the database first.
    threshold = now - timezone.timedelta(seconds=interval * (1 + HEARTBEAT_GRACE_INTERVALS))
    candidates = (
        Node.objects.select_for_update()
        .filter(Q(status=NodeStatus.ONLINE) | Q(status=NodeStatus.DEGRADED))
        .filter(last_heartbeat_at__lte=threshold)
    )
    changed: dict[str, list[int]] = {NodeStatus.DEGRADED: [], NodeStatus.LOST: []}
    held: list[int] = []
    for node in candidates:
        if node.last_heartbeat_at is None:  # excluded by the filter; keeps mypy honest
            continue
        if blind_until and grace_end and node.last_heartbeat_at < blind_until and now < grace_end:
            held.append(node.pk)
            continue
        missed = missed_beats(last_heartbeat_at=node.last_heartbeat_at, now=now)
        target = NodeStatus.LOST if missed >= limit else NodeStatus.DEGRADED
        if missed < 1 or target == node.status:
            continue
        previous = node.status
        node.status = target
        node.save(update_fields=["status", "updated_at"])
        changed[target].append(node.pk)
        audit_record(
            actor=None,
            actor_label="liveness",
            action=AuditAction.ACTION,
            verb="node_status",
            instance=node,
            before={"status": previous},
            after={"status": target, "missed_beats": missed},
        )
        logger.warning(
            "node_status_changed",
            extra={"node": node.pk, "from": previous, "to": target, "missed_beats": missed},
        )
    if held:
        logger.info(
            "liveness_held",
            extra={"nodes": held, "blind_until": blind_until, "judged_from": grace_end},
        )
    return {str(k): v for k, v in changed.items()}
