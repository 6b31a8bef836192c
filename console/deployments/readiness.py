"""The readiness checklist of a deployment (the deployment guide's six items), computed from
what the console knows now. An item whose data source does not exist yet is ``unknown`` with
the reason, never a pass. Called by the deployment page (blocking, a bounded number of
queries: one per item at most)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from console.deployments.choices import PoolRole
from console.deployments.models import Deployment, Pool
from console.drills.choices import ReportState
from console.drills.models import DrillReport
from console.inventory.choices import NodeStatus
from console.inventory.models import Link
from console.telemetry.models import MetricSample
from console.telemetry.services import subject_key

MONITORING_FRESH = timedelta(minutes=5)
DRILL_RECENT = timedelta(days=7)
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


def _weights(deployment: Deployment) -> Item:
    title = "Weights on both sites with matching hashes"
    if not deployment.model.weights_sha256:
        return Item("weights", title, "fail", "the model has no registered weights sha256")
    return Item(
        "weights",
        title,
        "unknown",
        "agents do not report the hash of the weights they hold yet; the model's is "
        f"{deployment.model.weights_sha256[:12]}…",
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


def _certificates(pools: list[Pool]) -> Item:
    title = "Certificates and allowlist in place"
    nodes = [node for pool in pools for node in pool.nodes.all()]
    if not nodes:
        return Item("certificates", title, "fail", "no nodes in the pools")
    reported = [n for n in nodes if isinstance((n.reported_capacity or {}).get("tls"), dict)]
    if len(reported) < len(nodes):
        return Item(
            "certificates",
            title,
            "unknown",
            f"{len(nodes) - len(reported)} of {len(nodes)} agents do not report TLS state in heartbeats",
        )
    off = [n.hostname for n in reported if not n.reported_capacity["tls"].get("mtls")]
    if off:
        return Item("certificates", title, "fail", f"mTLS off on {', '.join(off)}")
    return Item("certificates", title, "pass", f"mTLS on for all {len(nodes)} agents")


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
        _weights(deployment),
        _instances(pools),
        _wan(pools),
        _certificates(pools),
        _monitoring(deployment),
        _drill(deployment),
    ]
