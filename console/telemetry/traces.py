"""Reads of request traces: one request's legs merged onto the console's clock, with where
to read each process's log on its own clock (selectors for the trace page and API).

Clocks. A trace's legs are offsets on its gateway's monotonic clock from ``started_at``
(already on the console's clock, see :func:`console.telemetry.services.trace_record_batch`).
Each engine node writes its log on its own clock: the time to look for a leg in that node's
log is the leg's console time plus that node's clock skew (node minus console, from its
heartbeats). Nothing here calls an agent.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.db.models import QuerySet
from django.urls import reverse

from console.inventory.agentlogs import process_names
from console.inventory.models import Node
from console.telemetry.models import RequestTrace

#: Which supervised children of a node hold the log of a leg (the agent's child kinds).
_CHILD_KINDS = {
    "prefill": "prefill-engine",
    "transfer": "prefill-engine",
    "decode": "decode-engine",
}
#: Bytes from the end of a child's log the suggested command reads.
LOG_TAIL_BYTES = 1 << 20


def traces_for(request_id: str) -> QuerySet[RequestTrace]:
    """Every stored trace of ``request_id`` (a retried id, or several gateways), newest first."""
    return RequestTrace.objects.filter(request_id=request_id).select_related("node__site")


def _node(hostname: str | None, site: str | None, fallback_site_id: int | None) -> Node | None:
    if not hostname:
        return None
    nodes = Node.objects.filter(hostname=hostname).select_related("site")
    if site:
        found = nodes.filter(site__name=site).first()
        if found is not None:
            return found
    if fallback_site_id is not None:
        found = nodes.filter(site_id=fallback_site_id).first()
        if found is not None:
            return found
    return nodes.first()


def _where(
    node: Node | None,
    kind: str | None,
    at: datetime,
    request_id: str,
    skew_ms: float | None = None,
) -> dict[str, Any]:
    """Where the log of a process on ``node`` covers ``at``: the node, its skew (``skew_ms``
    when given: the one the trace was converted with; else the node's latest), the time on
    its clock, its child names of ``kind`` and the operator command that reads them."""
    if node is None:
        return {"node": None}
    skew_ms = node.clock_skew_ms if skew_ms is None else skew_ms
    skew = skew_ms or 0.0
    children = process_names(node.reported_children, kind)
    child = children[0] if children else "<child>"
    return {
        "node": node,
        "node_id": node.pk,
        "hostname": node.hostname,
        "site": node.site.name,
        "agent_address": node.agent_address,
        "skew_ms": skew_ms,
        "node_time": at + timedelta(milliseconds=skew),
        "children": children,
        # The console's log page of each child, on the lines of this request (operators).
        "log_pages": {
            name: f"{reverse('node-log-page', args=[node.pk, name])}?{urlencode({'q': request_id})}"
            for name in children
        },
        "command": (
            f"pdbridge agent ctl --address {node.agent_address} logs {child} "
            f"--offset -{LOG_TAIL_BYTES} | grep -F '{request_id}'"
        ),
    }


def trace_timeline(trace: RequestTrace) -> dict[str, Any]:
    """One trace as the page draws it: legs with console times and bar geometry (percent of
    the request's span), and each leg's log location on its node's clock."""
    doc = trace.document
    legs = [leg for leg in doc.get("legs", []) if isinstance(leg, dict)]
    ends = [leg.get("end_ms") or leg.get("start_ms") or 0.0 for leg in legs]
    span = max([doc.get("total_ms") or 0.0, *ends, 0.001])
    gateway_site = trace.node.site_id if trace.node is not None else None
    rows = []
    for leg in legs:
        start = float(leg.get("start_ms") or 0.0)
        end = leg.get("end_ms")
        end_ms = float(end) if end is not None else span
        at = trace.started_at + timedelta(milliseconds=start)
        instance = leg.get("instance")
        where = None
        if instance:
            node = _node(instance, leg.get("site"), gateway_site)
            # The gateway's own node: the skew its times were converted with, so the page
            # gives one clock per node (its latest skew may have moved since).
            same = node is not None and node.pk == trace.node_id
            skew = trace.skew_ms if same else None
            where = _where(node, _CHILD_KINDS.get(leg["leg"]), at, trace.request_id, skew)
            where["instance"] = instance
        rows.append(
            {
                **leg,
                "duration_ms": round(end_ms - start, 3),
                "at": at,
                "left_pct": round(100 * start / span, 3),
                "width_pct": round(max(100 * (end_ms - start) / span, 0.4), 3),
                "where": where,
            }
        )
    gateway = _where(trace.node, "gateway", trace.started_at, trace.request_id, trace.skew_ms)
    return {"trace": trace, "doc": doc, "legs": rows, "span_ms": span, "gateway": gateway}
