"""Deployment writes. Every change locks the deployment row, applies the change, and — when
the config document changed — raises ``version`` by one and writes an immutable
``ConfigSnapshot`` with its diff, plus the audit log, all in one transaction.

Called by the API views (operators), by inventory/catalog services when something a config
names changes (``deployments_refresh``) and later by the orchestrator
(``deployment_transition``). Blocking. Failures: ``ValidationError`` naming the field (400),
``StaleVersionError`` / ``Conflict`` (409).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q

from console.catalog.models import ModelSpec
from console.core.api.exceptions import Conflict
from console.core.choices import AuditAction
from console.core.crud import Actor, audited_create, audited_delete, audited_update
from console.core.services import audit_record
from console.deployments.choices import STATE_TRANSITIONS, DeploymentState, PoolRole
from console.deployments.config import build_config, config_diff
from console.deployments.models import ConfigSnapshot, Deployment, Pool
from console.inventory.choices import SiteRole
from console.inventory.models import Node, Site

logger = logging.getLogger(__name__)

# Config sections whose keys are Deployment fields of the same name (restore copies them back).
SETTING_SECTIONS = ("routing", "circuit_breaker", "kv_transfer", "prefill")
DELETABLE_STATES = {DeploymentState.DRAFT, DeploymentState.FAILED, DeploymentState.RETIRED}


class StaleVersionError(Conflict):
    """409: the write named a version that is no longer current."""

    def __init__(self, current_version: int, given: int) -> None:
        super().__init__(
            f"Stale version {given}: the deployment is at version {current_version}. "
            "Re-read it and apply your change again."
        )
        self.current_version = current_version
        # Keep the version an integer in the body (APIException would make it a string).
        self.detail = {"detail": self.detail, "current_version": current_version}  # type: ignore[assignment]


def _actor_user(actor: Actor) -> Any:
    return actor if actor is not None and actor.is_authenticated else None


def _lock(deployment: Deployment, expected_version: int | None = None) -> Deployment:
    locked = Deployment.objects.select_for_update().select_related("model").get(pk=deployment.pk)
    if expected_version is not None and expected_version != locked.version:
        raise StaleVersionError(locked.version, expected_version)
    return locked


def snapshot_write(*, actor: Actor, deployment: Deployment, reason: str) -> ConfigSnapshot | None:
    """Write the next snapshot if the config document differs from the latest one (caller
    holds the row lock). Returns the new snapshot, or None when nothing changed."""
    config = build_config(deployment)
    latest = deployment.snapshots.order_by("-version").first()
    if latest is not None and latest.config == config:
        return None
    version = latest.version + 1 if latest else 1
    deployment.version = version
    deployment.save(update_fields=["version", "updated_at"])
    user = _actor_user(actor)
    logger.info(
        "deployment_config_version",
        extra={"deployment": deployment.pk, "version": version, "reason": reason},
    )
    _audit_allowlist(actor, deployment, latest.config if latest else None, config, reason)
    return ConfigSnapshot.objects.create(
        deployment=deployment,
        version=version,
        config=config,
        diff=config_diff(latest.config if latest else None, config),
        reason=reason[:200],
        author=user,
        author_label=user.get_username() if user else "system",
    )


def _audit_allowlist(
    actor: Actor,
    deployment: Deployment,
    old: dict[str, Any] | None,
    new: dict[str, Any],
    reason: str,
) -> None:
    """An audit entry (verb ``kv_allowlist``, shown on the security page) whenever the resolved
    KV allowlist changes -- whatever changed it: the operator's ``extra_allowed_peers``, a
    prefill pool's nodes, a node's hostname, a restore."""
    before = (old or {}).get("kv_transfer", {}).get("allowed_peers", [])
    after = new["kv_transfer"]["allowed_peers"]
    if before == after:
        return
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="kv_allowlist",
        instance=deployment,
        before={"allowed_peers": before},
        after={
            "allowed_peers": after,
            "extra_allowed_peers": new["kv_transfer"]["extra_allowed_peers"],
            "reason": reason[:200],
        },
    )
    logger.info(
        "deployment_kv_allowlist",
        extra={
            "deployment": deployment.pk,
            "added": sorted(set(after) - set(before)),
            "removed": sorted(set(before) - set(after)),
            "reason": reason,
        },
    )


@transaction.atomic
def deployment_create(*, actor: Actor, **fields: Any) -> Deployment:
    """Create a deployment (state ``draft``) and its config version 1."""
    deployment = audited_create(actor=actor, model=Deployment, fields=fields)
    snapshot_write(actor=actor, deployment=deployment, reason="created")
    return deployment


@transaction.atomic
def deployment_update(
    *,
    actor: Actor,
    deployment: Deployment,
    expected_version: int | None = None,
    reason: str = "updated",
    **fields: Any,
) -> Deployment:
    """Change settings (or name, model, description). With ``expected_version`` the write is
    refused (409) unless the deployment is still at that version: two operators editing the
    same deployment never overwrite each other silently. ``reason`` labels the snapshot
    (automation names itself: ``tidal 14:00``)."""
    locked = _lock(deployment, expected_version)
    locked, changed = audited_update(actor=actor, instance=locked, fields=fields)
    if changed:
        snapshot_write(actor=actor, deployment=locked, reason=reason)
    return locked


@transaction.atomic
def deployment_set_kill_switch(
    *, actor: Actor, deployment: Deployment, enabled: bool
) -> Deployment:
    """Flip the kill switch (everything local when on). Needs no version: it must work in an
    emergency whoever else is editing. Idempotent: the same value writes nothing."""
    locked = _lock(deployment)
    if locked.kill_switch == enabled:
        return locked
    locked.kill_switch = enabled
    locked.save(update_fields=["kill_switch", "updated_at"])
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="kill_switch",
        instance=locked,
        before={"kill_switch": not enabled},
        after={"kill_switch": enabled},
    )
    snapshot_write(
        actor=actor, deployment=locked, reason=f"kill switch {'on' if enabled else 'off'}"
    )
    return locked


def _restore_pools(deployment: Deployment, pools_doc: dict[str, Any]) -> None:
    wanted = []
    if pools_doc.get("decode"):
        wanted.append((PoolRole.DECODE, pools_doc["decode"]))
    wanted += [(PoolRole.PREFILL, doc) for doc in pools_doc.get("prefill", [])]
    missing: list[str] = []
    resolved = []
    for role, doc in wanted:
        site = Site.objects.filter(name=doc["site"]).first()
        if site is None:
            missing.append(f"site {doc['site']}")
            continue
        hostnames = [n["hostname"] for n in doc["nodes"]]
        nodes = list(Node.objects.filter(site=site, hostname__in=hostnames))
        missing += [
            f"node {h}@{site.name}" for h in sorted(set(hostnames) - {n.hostname for n in nodes})
        ]
        resolved.append((role, site, nodes, doc["engine_settings"]))
    if missing:
        raise Conflict(f"Cannot restore: no longer in the inventory: {', '.join(missing)}.")
    # Drained is the running fleet's state, not configuration: a node drained now stays
    # drained (its engine may be stopped), whatever the restored version said.
    drained = {
        (p.role, p.site_id): {n.pk for n in p.drained_nodes.all()}
        for p in deployment.pools.prefetch_related("drained_nodes")
    }
    deployment.pools.all().delete()
    for role, site, nodes, engine_settings in resolved:
        pool = Pool.objects.create(
            deployment=deployment, role=role, site=site, engine_settings=engine_settings
        )
        pool.nodes.set(nodes)
        keep = drained.get((role, site.pk), set())
        pool.drained_nodes.set([n for n in nodes if n.pk in keep])


@transaction.atomic
def deployment_restore(
    *,
    actor: Actor,
    deployment: Deployment,
    version: int,
    expected_version: int | None = None,
) -> Deployment:
    """Make version ``version``'s configuration current again, as a new version: settings,
    model and pools are set back (state is lifecycle, not configuration, and stays; a kill
    switch that is on stays on). 409 when a model, site or node that version names no longer
    exists."""
    locked = _lock(deployment, expected_version)
    target = locked.snapshots.filter(version=version).first()
    if target is None:
        raise ValidationError({"version": [f"Deployment {locked.name} has no version {version}."]})
    config = target.config
    fields: dict[str, Any] = {}
    for section in SETTING_SECTIONS:
        fields.update(config[section])
    # Derived from the pools, not a setting; a version from before the field had no extras.
    fields.pop("allowed_peers", None)
    fields.setdefault("extra_allowed_peers", [])
    model = ModelSpec.objects.filter(name=config["model"]["name"]).first()
    if model is None:
        raise Conflict(f"Cannot restore: model {config['model']['name']} no longer exists.")
    fields["model"] = model
    # Safety: a restore never turns the kill switch off; that is always an explicit act.
    fields["kill_switch"] = fields["kill_switch"] or locked.kill_switch
    before_version = locked.version
    locked, _ = audited_update(actor=actor, instance=locked, fields=fields)
    _restore_pools(locked, config["pools"])
    snapshot = snapshot_write(actor=actor, deployment=locked, reason=f"restore of v{version}")
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="restore",
        instance=locked,
        before={"version": before_version},
        after={"version": locked.version, "restored": version, "changed": snapshot is not None},
    )
    return locked


@transaction.atomic
def deployment_transition(*, actor: Actor, deployment: Deployment, to_state: str) -> Deployment:
    """Move the deployment to ``to_state`` if ``STATE_TRANSITIONS`` allows it (else 409).
    Called by the deployment workflow (orchestrator) and by retire."""
    locked = _lock(deployment)
    if to_state not in STATE_TRANSITIONS[locked.state]:
        raise Conflict(f"A deployment cannot go from {locked.state} to {to_state}.")
    before = locked.state
    locked.state = to_state
    locked.save(update_fields=["state", "updated_at"])
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="state",
        instance=locked,
        before={"state": before},
        after={"state": to_state},
    )
    snapshot_write(actor=actor, deployment=locked, reason=f"state {before} -> {to_state}")
    return locked


@transaction.atomic
def deployment_delete(
    *, actor: Actor, deployment: Deployment, expected_version: int | None = None
) -> None:
    """Delete a deployment that is not serving (draft, failed or retired; else 409), with its
    pools and snapshots. The audit log keeps the record."""
    locked = _lock(deployment, expected_version)
    if locked.state not in DELETABLE_STATES:
        raise Conflict(f"Deployment {locked.name} is {locked.state}: retire it before deleting.")
    audited_delete(actor=actor, instance=locked)


def _check_pool(*, role: str, site: Site, nodes: Iterable[Node]) -> None:
    allowed = {
        PoolRole.DECODE: {SiteRole.DECODE, SiteRole.BOTH},
        PoolRole.PREFILL: {SiteRole.PREFILL, SiteRole.BOTH},
    }
    if site.role not in allowed[PoolRole(role)]:
        raise ValidationError(
            {"site": [f"Site {site.name} has role {site.role}: it cannot host a {role} pool."]}
        )
    elsewhere = sorted(n.hostname for n in nodes if n.site_id != site.pk)
    if elsewhere:
        raise ValidationError({"nodes": [f"Not at site {site.name}: {', '.join(elsewhere)}."]})


@transaction.atomic
def pool_create(
    *,
    actor: Actor,
    deployment: Deployment,
    role: str,
    site: Site,
    nodes: list[Node] | None = None,
    engine_settings: dict[str, Any] | None = None,
    expected_version: int | None = None,
) -> Pool:
    """Add a pool to a deployment (one decode pool, any number of prefill pools, one per
    site); the deployment gets a new config version."""
    nodes = list(nodes or [])
    _check_pool(role=role, site=site, nodes=nodes)
    locked = _lock(deployment, expected_version)
    pool = audited_create(
        actor=actor,
        model=Pool,
        fields={
            "deployment": locked,
            "role": role,
            "site": site,
            "nodes": nodes,
            "engine_settings": engine_settings if engine_settings is not None else {},
        },
    )
    snapshot_write(actor=actor, deployment=locked, reason=f"{role} pool at {site.name} added")
    return pool


@transaction.atomic
def pool_update(
    *, actor: Actor, pool: Pool, expected_version: int | None = None, **fields: Any
) -> Pool:
    """Change a pool's site, nodes or engine settings (not its deployment or role)."""
    fields.pop("deployment", None)
    fields.pop("role", None)
    site = fields.get("site", pool.site)
    nodes = fields["nodes"] if "nodes" in fields else list(pool.nodes.all())
    _check_pool(role=pool.role, site=site, nodes=nodes)
    locked = _lock(pool.deployment, expected_version)
    pool, changed = audited_update(actor=actor, instance=pool, fields=fields)
    if changed:
        snapshot_write(actor=actor, deployment=locked, reason=f"{pool.role} pool changed")
    return pool


@transaction.atomic
def pool_set_drained(
    *,
    actor: Actor,
    pool: Pool,
    drain: Iterable[Node] = (),
    rejoin: Iterable[Node] = (),
    reason: str = "drain",
) -> int:
    """Take nodes of ``pool`` out of the gateways' rotation (``drain``) or put them back
    (``rejoin``): the config document marks a drained node ``drained: true`` and every
    gateway stops sending it new legs once it has applied that version (in-flight ones
    finish). Called by the tidal job before it stops an engine and after a launched one is
    healthy, and by operators. Returns the deployment's config version after the change (a
    new one when the drained set changed, else the current one). 400 naming ``drain`` for a
    node that is not in the pool."""
    drain, rejoin = list(drain), list(rejoin)
    locked = _lock(pool.deployment)
    members = {n.pk for n in pool.nodes.all()}
    strangers = sorted(n.hostname for n in drain if n.pk not in members)
    if strangers:
        raise ValidationError({"drain": [f"Not in this pool: {', '.join(strangers)}."]})
    before = sorted(n.hostname for n in pool.drained_nodes.all())
    pool.drained_nodes.add(*drain)
    pool.drained_nodes.remove(*(n for n in rejoin if n not in drain))
    after = sorted(n.hostname for n in pool.drained_nodes.all())
    if before == after:
        return locked.version
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="drain",
        instance=locked,
        before={"pool": pool.pk, "drained": before},
        after={"pool": pool.pk, "drained": after, "reason": reason[:200]},
    )
    snapshot_write(actor=actor, deployment=locked, reason=reason)
    return locked.version


@transaction.atomic
def pool_delete(*, actor: Actor, pool: Pool, expected_version: int | None = None) -> None:
    """Remove a pool; the deployment gets a new config version."""
    locked = _lock(pool.deployment, expected_version)
    role = pool.role
    audited_delete(actor=actor, instance=pool)
    snapshot_write(actor=actor, deployment=locked, reason=f"{role} pool removed")


@transaction.atomic
def deployments_refresh(
    *,
    actor: Actor,
    reason: str,
    site_ids: Iterable[int | None] | None = None,
    node_ids: Iterable[int] | None = None,
    model_ids: Iterable[int] | None = None,
) -> list[int]:
    """Re-snapshot the deployments whose config names the given sites, nodes or models,
    after an inventory or catalog change. Called by those apps' services; a deployment whose
    document did not change gets no new version. Returns the ids that got one."""
    query = Q(pk__in=[])
    if site_ids:
        query |= Q(pools__site_id__in=[s for s in site_ids if s is not None])
    if node_ids:
        query |= Q(pools__nodes__id__in=list(node_ids))
    if model_ids:
        query |= Q(model_id__in=list(model_ids))
    refreshed = []
    for pk in (
        Deployment.objects.filter(query).values_list("pk", flat=True).distinct().order_by("pk")
    ):
        locked = Deployment.objects.select_for_update().get(pk=pk)
        if snapshot_write(actor=actor, deployment=locked, reason=reason) is not None:
            refreshed.append(pk)
    return refreshed


def deployment_engine_relaunched(*, deployment: Deployment, evidence: dict[str, Any]) -> None:
    """Audit one relaunch of a child the reconcile loop found absent on a node
    (``orchestrator.reconcile``): ``evidence`` is what the agent answered, or the error."""
    audit_record(
        actor=None,
        actor_label="reconcile",
        action=AuditAction.ACTION,
        verb="engine_relaunch",
        instance=deployment,
        after=evidence,
    )
