"""Cross-cutting pages: the overview, the audit log, the security page, plus health, the
console's own Prometheus metrics and plotly.js. Reads only; every page any role may read."""

from __future__ import annotations

import gzip
import hashlib
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

from django.db import connection
from django.db.models import Count, Prefetch, Q, Sum, TextField
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_GET

from console.core.models import AuditLog
from console.core.pages import page_view, paginate
from console.core.panels import overview_panels
from console.deployments.choices import DeploymentState
from console.deployments.models import Deployment, Pool
from console.deployments.readiness import CERT_WARN_DAYS
from console.inventory.choices import NodeStatus
from console.inventory.models import Link, Node, Site
from console.runs.models import WorkflowRun
from console.telemetry import names
from console.telemetry.selectors import latest_many, sums_by_path

PATHS = ("remote", "local", "fallback")


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness and database reachability, for load balancers and the testbed (no auth)."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return JsonResponse({"status": "ok", "database": "ok"})
    except Exception as exc:  # any database failure means "not ready"
        return JsonResponse({"status": "error", "database": type(exc).__name__}, status=503)


#: plotly.js's partial bundle with the trace types the console draws (scatter, bar): a quarter
#: of the full bundle. Used only while its version is the one the installed plotly package
#: ships (the figures' JSON is written for that version); else the package's full bundle.
PLOTLY_BASIC = Path(__file__).parent / "static" / "console" / "vendor" / "plotly-basic-4.1.1.min.js"
_PLOTLY_VERSION = re.compile(rb"plotly\.js(?: \([a-z -]+\))? v([0-9][0-9.]*)")


def plotly_version(bundle: bytes) -> str:
    """The version in a plotly.js bundle's banner ("" when there is none)."""
    found = _PLOTLY_VERSION.search(bundle[:300])
    return found.group(1).decode() if found else ""


@dataclass(frozen=True)
class PlotlyBundle:
    name: str
    raw: bytes
    gzipped: bytes
    etag: str


@cache
def plotly_bundle() -> PlotlyBundle:
    """The bundle the console serves, with its gzip form and ETag, built once per process."""
    import plotly

    full = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    basic = PLOTLY_BASIC.read_bytes()
    name, raw = (
        ("basic", basic) if plotly_version(basic) == plotly_version(full) else ("full", full)
    )
    digest = hashlib.sha256(raw).hexdigest()[:16]
    return PlotlyBundle(name, raw, gzip.compress(raw, compresslevel=6, mtime=0), f'"{digest}"')


@require_GET
def plotly_js(request: HttpRequest) -> HttpResponse:
    """plotly.js for every chart page, from the console itself (no CDN): the partial bundle
    when it matches the installed plotly (see ``plotly_bundle``), gzip-compressed for clients
    that accept it (1.2 MB -> 0.4 MB), with an ETag so a reload costs a 304."""
    bundle = plotly_bundle()
    if request.headers.get("If-None-Match") == bundle.etag:
        response = HttpResponse(status=304)
    elif "gzip" in request.headers.get("Accept-Encoding", ""):
        response = HttpResponse(bundle.gzipped, content_type="application/javascript")
        response["Content-Encoding"] = "gzip"
    else:
        response = HttpResponse(bundle.raw, content_type="application/javascript")
    response["ETag"] = bundle.etag
    response["Vary"] = "Accept-Encoding"
    response["Cache-Control"] = "public, max-age=86400"
    response["X-Plotly-Bundle"] = bundle.name
    return response


def path_mix(values: dict[str, float]) -> list[dict[str, Any]]:
    """``{"remote": 3.0, "local": 1.0}`` -> shares per path for the path bar (empty if no
    traffic was recorded)."""
    total = sum(values.get(p, 0.0) for p in PATHS)
    if total <= 0:
        return []
    return [
        {
            "path": p,
            "share": values.get(p, 0.0) / total,
            "percent": round(100 * values.get(p, 0.0) / total),
        }
        for p in PATHS
    ]


def _overview_sites() -> list[dict[str, Any]]:
    sites = Site.objects.annotate(
        n_online=Count("nodes", filter=Q(nodes__status=NodeStatus.ONLINE)),
        n_degraded=Count("nodes", filter=Q(nodes__status=NodeStatus.DEGRADED)),
        n_lost=Count("nodes", filter=Q(nodes__status=NodeStatus.LOST)),
        n_unknown=Count("nodes", filter=Q(nodes__status=NodeStatus.UNKNOWN)),
        n_nodes=Count("nodes"),
        n_accelerators=Sum("nodes__accelerator_count"),
    ).order_by("name")
    return list(sites)


@page_view
@require_GET
def overview(request: HttpRequest) -> HttpResponse:
    """Sites with node health, links with their latest measurements, deployments with their
    path mix and kill switch, active runs. Bounded queries whatever the fleet size."""
    since = timezone.now() - timedelta(hours=1)
    links = list(Link.objects.select_related("from_site", "to_site"))
    link_latest = latest_many(
        subject_type="inventory.link",
        subject_ids=[str(link.pk) for link in links],
        names=[names.LINK_UTILIZATION],
        since=since,
    )
    for link in links:
        link.utilization = link_latest.get((str(link.pk), names.LINK_UTILIZATION, ""))
    deployments = list(
        Deployment.objects.exclude(state=DeploymentState.RETIRED)
        .select_related("model")
        .prefetch_related(Prefetch("pools", queryset=Pool.objects.select_related("site")))
    )
    # The mix of the whole hour: the latest rate alone is zero once traffic pauses.
    dep_sums = sums_by_path(
        subject_type="deployments.deployment",
        subject_ids=[str(d.pk) for d in deployments],
        name=names.REQUESTS,
        since=since,
    )
    for dep in deployments:
        dep.mix = path_mix({p: dep_sums.get((str(dep.pk), p), 0.0) for p in PATHS})
    active = list(
        WorkflowRun.objects.filter(state__in=["pending", "running"])
        .prefetch_related("steps")
        .order_by("-created_at")[:20]
    )
    context = {
        "sites": _overview_sites(),
        "links": links,
        "deployments": deployments,
        "active_runs": active,
        "panels": overview_panels(request),
    }
    return render(request, "core/overview.html", context)


@page_view
@require_GET
def audit_log(request: HttpRequest) -> HttpResponse:
    """Every write, newest first; filter by object type, actor or verb."""
    entries = AuditLog.objects.all()
    filters = {
        "object_type": request.GET.get("object_type", "").strip(),
        "actor": request.GET.get("actor", "").strip(),
        "verb": request.GET.get("verb", "").strip(),
    }
    if filters["object_type"]:
        entries = entries.filter(object_type=filters["object_type"])
    if filters["actor"]:
        entries = entries.filter(actor_label=filters["actor"])
    if filters["verb"]:
        entries = entries.filter(verb=filters["verb"])
    return render(
        request,
        "core/audit_log.html",
        {"page": paginate(request, entries), "filters": filters},
    )


def _tls_status(node: Node, now: datetime) -> dict[str, Any]:
    """What a node's last heartbeat says about its TLS (``reported_tls``: mTLS, certificate
    subject, SANs, not-after, CA fingerprint, allowlist size); unknown, with why, until the
    agent reports it."""
    tls = node.reported_tls
    if node.last_heartbeat_at is None:
        return {"state": "unknown", "why": "no heartbeat received yet"}
    if not isinstance(tls, dict):
        return {"state": "unknown", "why": "this agent has not reported its TLS state yet"}
    expiry = parse_datetime(str(tls.get("not_after") or ""))
    days = (expiry - now).days if expiry is not None and expiry.tzinfo else None
    if not tls.get("mtls"):
        state = "fail"
    elif tls.get("error") or days is None:
        state = "unknown"
    elif expiry is not None and expiry < now:
        state = "expired"
    elif days < CERT_WARN_DAYS:
        state = "warning"
    else:
        state = "ok"
    return {
        "state": state,
        "mtls": bool(tls.get("mtls")),
        "expiry": expiry,
        "days": days,
        "subject": tls.get("subject") or "",
        "sans": tls.get("sans") or [],
        "ca_fingerprint": tls.get("ca_fingerprint") or "",
        "allowlist_size": tls.get("allowlist_size"),
        "why": tls.get("error") or "",
    }


@page_view
@require_GET
def security(request: HttpRequest) -> HttpResponse:
    """mTLS and certificate expiry per agent (from heartbeats), node credentials, links, and
    allowlist changes from the audit log."""
    now = timezone.now()
    nodes = list(Node.objects.select_related("site", "credential"))
    rows = [{"node": node, "tls": _tls_status(node, now)} for node in nodes]
    allowlist = AuditLog.objects.annotate(
        before_text=Cast("before", TextField()), after_text=Cast("after", TextField())
    ).filter(
        Q(before_text__contains="allow_peers")
        | Q(after_text__contains="allow_peers")
        | Q(verb__icontains="allowlist")
    )
    return render(
        request,
        "core/security.html",
        {
            "rows": rows,
            "links": Link.objects.select_related("from_site", "to_site"),
            "allowlist": paginate(request, allowlist),
            "warn_days": CERT_WARN_DAYS,
        },
    )
