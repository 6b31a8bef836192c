"""The readiness checklist of a deployment (the deployment guide's six items), computed from
what the console knows now, agents' heartbeats included. An item whose data has not arrived yet
(a node that has not reported) is ``unknown`` with the reason, never a pass. Called by the deployment page (blocking, a bounded number of
queries: one per item at most)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from console.deployments.choices import PoolRole
from console.deployments.models import Deployment, Pool
from console.drills.choices import ReportState
from console.drills.models import DrillReport
from console.inventory.choices import NodeStatus
from console.inventory.models import Link, Node
from console.telemetry.models import MetricSample
from console.telemetry.services import subject_key

MONITORING_FRESH = timedelta(minutes=5)
DRILL_RECENT = timedelta(days=7)
#: A certificate expiring sooner than this fails readiness and is flagged on the Security page.
CERT_WARN_DAYS = 14
ENGINE_KIND = {PoolRole.DECODE: "decode-engine", PoolRole.PREFILL: "prefill-engine"}


@dataclass(frozen=True)
class Item:
    """One checklist line: ``state`` is pass / fail / unknown; ``detail`` says why."""

    key: str
    title: str
    state: str
    detail: str


def _api_exists(url_name: str, pk: int) -> bool:
    try:
        reverse(url_name, args=[pk])
    except NoReverseMatch:
        return False
    return True


def _pool_nodes(pools: list[Pool]) -> list[tuple[Pool, Node]]:
    return [(pool, node) for pool in pools for node in pool.nodes.all()]


def _label(pool: Pool, node: Node) -> str:
    return f"{node.hostname}@{pool.site.name}"


def _weights_entries(deployment: Deployment, pool: Pool, node: Node) -> list[dict[str, Any]]:
    """What ``node`` reports for this deployment's model: the weights of its engine children of
    this deployment (their served name may differ from the catalog's), else the models it
    holds under the catalog name, else the engines' errors."""
    reports = [e for e in node.reported_weights or [] if isinstance(e, dict)]
    engines = {
        c.get("name")
        for c in node.reported_children
        if c.get("deployment_id") == deployment.pk
        and c.get("kind") == ENGINE_KIND[PoolRole(pool.role)]
    }
    served = [e for e in reports if e.get("child") and e.get("child") in engines]
    held = [e for e in reports if not e.get("child") and e.get("model") == deployment.model.name]
    # An engine whose model the agent cannot resolve to local files (a vLLM engine given a hub
    # id) says nothing about the weights; the checkpoint listed in agent.yaml then does.
    resolved = [e for e in served if e.get("state") != "error"]
    return resolved or held or served


def _weights(deployment: Deployment, pools: list[Pool]) -> Item:
    title = "Weights on both sites with matching hashes"
    expected = deployment.model.weights_sha256
    if not expected:
        return Item("weights", title, "fail", "the model has no registered weights sha256")
    missing_roles = [
        r for r in (PoolRole.DECODE, PoolRole.PREFILL) if r not in {p.role for p in pools}
    ]
    if missing_roles:
        return Item("weights", title, "fail", f"no {' or '.join(missing_roles)} pool")
    nodes = _pool_nodes(pools)
    if not nodes:
        return Item("weights", title, "fail", "no nodes in the pools")
    problems: list[str] = []
    waiting: list[str] = []
    for pool, node in nodes:
        label = _label(pool, node)
        if node.reported_weights is None:
            waiting.append(f"{label} has not reported its weights yet")
            continue
        entries = _weights_entries(deployment, pool, node)
        if not entries:
            problems.append(f"{label} reports no weights of {deployment.model.name}")
        for entry in entries:
            where = entry.get("path") or entry.get("model")
            if entry.get("state") == "hashing":
                waiting.append(f"{label} is still hashing {where}")
            elif entry.get("state") != "ok":
                problems.append(f"{label}: {entry.get('detail') or 'weights unreadable'}")
            elif entry.get("sha256") != expected:
                problems.append(
                    f"{label} has {entry.get('sha256')} at {where}, the catalog says {expected}"
                )
    if problems:
        return Item("weights", title, "fail", "; ".join(problems))
    if waiting:
        return Item("weights", title, "unknown", "; ".join(waiting))
    sites = sorted({pool.site.name for pool, _ in nodes})
    return Item(
        "weights",
        title,
        "pass",
        f"{len(nodes)} nodes at {', '.join(sites)} hold weights {expected[:12]}…",
    )


def _instances(pools: list[Pool]) -> Item:
    title = "Instances up on both sites"
    roles = {pool.role for pool in pools}
    missing = [r for r in (PoolRole.DECODE, PoolRole.PREFILL) if r not in roles]
    if missing:
        return Item("instances", title, "fail", f"no {' or '.join(missing)} pool")
    problems = []
    for pool in pools:
        engine = ENGINE_KIND[PoolRole(pool.role)]
        up = [
            node
            for node in pool.nodes.all()
            if node.status == NodeStatus.ONLINE
            and any(c.get("kind") == engine and c.get("healthy") for c in node.reported_children)
        ]
        if not up:
            problems.append(f"{pool.role}@{pool.site.name}: no online node with a healthy {engine}")
    if problems:
        return Item("instances", title, "fail", "; ".join(problems))
    return Item("instances", title, "pass", f"{len(pools)} pools each have a healthy engine")


def _wan(pools: list[Pool]) -> Item:
    title = "WAN bandwidth and routing measured"
    decode = [p.site_id for p in pools if p.role == PoolRole.DECODE]
    prefill = {p.site_id for p in pools if p.role == PoolRole.PREFILL}
    if not decode or not prefill:
        return Item("wan", title, "fail", "needs a decode pool and a prefill pool first")
    links = list(
        Link.objects.select_related("from_site").filter(
            from_site_id__in=prefill, to_site_id=decode[0]
        )
    )
    found = {link.from_site_id for link in links}
    if found != prefill:
        return Item("wan", title, "fail", "a prefill site has no link to the decode site")
    unmeasured = [
        link.from_site.name for link in links if link.measured_mbit_s is None or link.rtt_ms is None
    ]
    if unmeasured:
        return Item("wan", title, "fail", f"not probed yet from {', '.join(unmeasured)}")
    return Item(
        "wan",
        title,
        "pass",
        ", ".join(
            f"{link.from_site.name}: {link.measured_mbit_s:.0f} Mbit/s, {link.rtt_ms:.1f} ms"
            for link in links
        ),
    )


def _kv_identity_problem(
    pool: Pool, node: Node, tls: dict[str, Any], extra_peers: list[str]
) -> str | None:
    """A prefill node whose certificate's identity -- its common name, the one name KV
    receivers match -- is neither its hostname nor an extra allowed peer would be refused by
    the deployment's KV receivers (they allow prefill nodes by hostname), whatever its SANs
    say. Judged on the common name the agent reports (``subject``); nothing reported, no
    verdict."""
    if pool.role != PoolRole.PREFILL:
        return None
    identity = str(tls.get("subject") or "")
    if not identity or identity == node.hostname or identity in extra_peers:
        return None
    names = [identity, *(str(n) for n in tls.get("sans") or [])]
    return (
        f"the certificate of {_label(pool, node)} has the common name {identity} (names "
        f"{', '.join(dict.fromkeys(n for n in names if n))}), not its hostname "
        f"{node.hostname}: the KV receivers match the common name only and would refuse it "
        "(reissue it for the hostname, or add its common name to extra_allowed_peers)"
    )


def _certificates(pools: list[Pool], now: datetime, extra_peers: list[str]) -> Item:
    title = "Certificates and allowlist in place"
    nodes = _pool_nodes(pools)
    if not nodes:
        return Item("certificates", title, "fail", "no nodes in the pools")
    problems: list[str] = []
    unreported: list[str] = []
    earliest: tuple[datetime, str] | None = None
    for pool, node in nodes:
        label = _label(pool, node)
        tls = node.reported_tls
        if not isinstance(tls, dict):
            unreported.append(label)
            continue
        if not tls.get("mtls"):
            problems.append(f"mTLS off on {label}")
            continue
        if tls.get("error"):
            problems.append(f"{label}: {tls['error']}")
            continue
        if not tls.get("allowlist_size"):
            problems.append(f"{label} has an empty allowlist (its control API refuses everyone)")
        problem = _kv_identity_problem(pool, node, tls, extra_peers)
        if problem:
            problems.append(problem)
        expiry = parse_datetime(str(tls.get("not_after") or ""))
        if expiry is None or expiry.tzinfo is None:
            problems.append(f"{label} reports no certificate expiry")
            continue
        days = (expiry - now).total_seconds() / 86400
        if days < 0:
            problems.append(f"the certificate of {label} expired on {expiry:%Y-%m-%d}")
        elif days < CERT_WARN_DAYS:
            problems.append(
                f"the certificate of {label} expires on {expiry:%Y-%m-%d}, in {int(days)} days "
                f"(under {CERT_WARN_DAYS})"
            )
        if earliest is None or expiry < earliest[0]:
            earliest = (expiry, label)
    if problems:
        return Item("certificates", title, "fail", "; ".join(problems))
    if unreported:
        return Item(
            "certificates",
            title,
            "unknown",
            f"{len(unreported)} of {len(nodes)} agents have not reported TLS state yet: "
            + ", ".join(unreported),
        )
    first = f"; first certificate expiry {earliest[0]:%Y-%m-%d} ({earliest[1]})" if earliest else ""
    return Item("certificates", title, "pass", f"mTLS on for all {len(nodes)} agents{first}")


def _monitoring(deployment: Deployment) -> Item:
    title = "Monitoring receiving data"
    subject_type, subject_id = subject_key(deployment)
    last = (
        MetricSample.objects.filter(subject_type=subject_type, subject_id=subject_id)
        .order_by("-at")
        .values_list("at", flat=True)
        .first()
    )
    if last is None:
        return Item("monitoring", title, "fail", "no metric sample recorded for this deployment")
    age = timezone.now() - last
    if age > MONITORING_FRESH:
        return Item("monitoring", title, "fail", f"last sample {int(age.total_seconds())} s ago")
    return Item("monitoring", title, "pass", f"last sample {int(age.total_seconds())} s ago")


def _drill(deployment: Deployment) -> Item:
    title = "A fallback drill passed recently"
    if not _api_exists("drill-run", 0):
        return Item("drill", title, "unknown", "drills are not available in this installation yet")
    # A drill's run targets the Drill, and its verdict is the report's (criteria judged), not
    # the run's state: a run can succeed while the drill failed its criteria.
    recent = DrillReport.objects.filter(
        drill__deployment=deployment,
        state=ReportState.PASSED,
        finished_at__gte=timezone.now() - DRILL_RECENT,
    ).exists()
    if recent:
        return Item("drill", title, "pass", "a drill passed in the last 7 days")
    return Item("drill", title, "fail", "no successful drill in the last 7 days")


def readiness(deployment: Deployment, pools: list[Pool]) -> list[Item]:
    """The six items for ``deployment``; ``pools`` with ``site`` and ``nodes`` loaded."""
    return [
        _weights(deployment, pools),
        _instances(pools),
        _wan(pools),
        _certificates(pools, timezone.now(), list(deployment.extra_allowed_peers or [])),
        _monitoring(deployment),
        _drill(deployment),
    ]
