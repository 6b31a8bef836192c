"""Inventory pages: sites, a site with its nodes and links, a node with its heartbeat
history, a link with its probe history. Reads only (inventory writes are the admin's, through
the API or the admin site)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_GET

from console.core.charts import time_chart
from console.core.choices import Role
from console.core.pages import page_view, paginate
from console.core.roles import user_has_role
from console.deployments.models import ConfigSnapshot
from console.inventory import agentlogs
from console.inventory.api.serializers import LogQuerySerializer
from console.inventory.choices import NodeStatus
from console.inventory.models import Link, Node, Site
from console.telemetry import names
from console.telemetry.charts import ChartSpec, history_charts
from console.telemetry.models import MetricSample
from console.telemetry.selectors import latest

HISTORY = timedelta(days=1)
#: Config versions marked on a link's charts (the newest; more would hide the lines).
MAX_EVENTS = 40


@page_view
@require_GET
def site_list(request: HttpRequest) -> HttpResponse:
    """Sites with node counts, paginated."""
    sites = Site.objects.annotate(
        n_nodes=Count("nodes"),
        n_online=Count("nodes", filter=Q(nodes__status=NodeStatus.ONLINE)),
    ).order_by("name")
    return render(request, "inventory/site_list.html", {"page": paginate(request, sites)})


@page_view
@require_GET
def site_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One site: its nodes (paginated), its links and their bandwidth history."""
    site = get_object_or_404(Site, pk=pk)
    nodes = paginate(request, site.nodes.all())
    links = list(
        Link.objects.select_related("from_site", "to_site").filter(
            Q(from_site=site) | Q(to_site=site)
        )
    )
    # One query for the bandwidth history of every link of the site.
    samples = MetricSample.objects.filter(
        subject_type="inventory.link",
        subject_id__in=[str(link.pk) for link in links],
        name=names.LINK_MEASURED_MBIT_S,
        at__gte=timezone.now() - HISTORY,
    ).order_by("at", "id")[:5000]
    label = {str(link.pk): f"{link.from_site.name} → {link.to_site.name}" for link in links}
    lines: dict[str, list[tuple[datetime, float]]] = {name: [] for name in label.values()}
    for sample in samples.values_list("subject_id", "at", "value"):
        lines[label[sample[0]]].append((sample[1], sample[2]))
    since = timezone.now() - HISTORY
    # The config versions of the deployments over any of these links, each once.
    events = sorted({e for link in links for e in config_events(link, since)})[-MAX_EVENTS:]
    chart = time_chart(
        title="Measured bandwidth of the site's links",
        lines=lines,
        y_title="Mbit/s",
        hint="Bandwidth probes of the links add points.",
        events=events,
    )
    return render(
        request,
        "inventory/site_detail.html",
        {"site": site, "page": nodes, "links": links, "chart": chart},
    )


@page_view
@require_GET
def node_list(request: HttpRequest) -> HttpResponse:
    """Every node, filtered by ``?site=<name>`` and ``?status=<status>`` (an unknown value is
    named in a message and ignored), paginated."""
    nodes = Node.objects.select_related("site").order_by("site__name", "hostname")
    chosen, problems = {}, []
    sites = list(Site.objects.order_by("name").values_list("name", flat=True))
    for key, allowed, field in (
        ("site", sites, "site__name"),
        ("status", [s.value for s in NodeStatus], "status"),
    ):
        value = request.GET.get(key, "")
        if not value:
            continue
        if value not in allowed:
            problems.append(f"{key}: {value!r} is not one of {', '.join(allowed) or '(none)'}")
            continue
        chosen[key] = value
        nodes = nodes.filter(**{field: value})
    return render(
        request,
        "inventory/node_list.html",
        {
            "page": paginate(request, nodes),
            "show_site": True,
            "filters": [
                ("site", sites, chosen.get("site", "")),
                ("status", [s.value for s in NodeStatus], chosen.get("status", "")),
            ],
            "chosen": chosen,
            "problems": problems,
        },
    )


@page_view
@require_GET
def link_list(request: HttpRequest) -> HttpResponse:
    """Every link with its last probe, the rate gateways score by, RTT, the utilisation the
    gateways last reported against the ceiling, and whether the measurement is stale."""
    links = list(Link.objects.select_related("from_site", "to_site"))
    for link in links:
        last = latest(subject=link, name=names.LINK_MEASURED_MBIT_S)
        used = latest(subject=link, name=names.LINK_UTILIZATION)
        link.last_probe = last[1] if last else None
        link.utilization = used[1] if used else None
    return render(request, "inventory/link_list.html", {"links": links})


@page_view
@require_GET
def node_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One node: hardware, its last heartbeat's report, pools, heartbeat history charts."""
    node = get_object_or_404(Node.objects.select_related("site"), pk=pk)
    since = timezone.now() - HISTORY
    charts = history_charts(
        subject=node,
        since=since,
        hint="Each heartbeat of the node's agent adds a point.",
        specs=[
            ChartSpec(
                "Supervised processes (healthy / total)",
                {"healthy": names.NODE_CHILDREN_HEALTHY, "total": names.NODE_CHILDREN_TOTAL},
                "processes",
                step=True,
                from_zero=True,
            ),
            ChartSpec("Clock skew against the console", {"skew": names.NODE_CLOCK_SKEW_MS}, "ms"),
        ],
    )
    beats = MetricSample.objects.filter(
        subject_type="inventory.node",
        subject_id=str(node.pk),
        name=names.NODE_CLOCK_SKEW_MS,
        at__gte=since,
    ).count()
    pools = node.pools.select_related("deployment")
    return render(
        request,
        "inventory/node_detail.html",
        {
            "node": node,
            "charts": charts,
            "pools": pools,
            "beats": beats,
            "can_read_logs": user_has_role(request.user, Role.OPERATOR),
            "children": agentlogs.process_names(node.reported_children),
        },
    )


@page_view
@require_GET
def link_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One link: latest probe and its bandwidth, RTT and utilisation history."""
    link = get_object_or_404(Link.objects.select_related("from_site", "to_site"), pk=pk)
    since = timezone.now() - HISTORY
    charts = history_charts(
        subject=link,
        since=since,
        hint="The link probe job (every PDBRIDGE_LINK_PROBE_S), deployment step 2 and the "
        "gateways' utilisation add points.",
        events=config_events(link, since),
        specs=[
            ChartSpec(
                "Measured bandwidth",
                {"measured": names.LINK_MEASURED_MBIT_S},
                "Mbit/s",
                limits={"provisioned": float(link.provisioned_mbit_s)},
            ),
            ChartSpec("Round-trip time", {"rtt": names.LINK_RTT_MS}, "ms"),
            ChartSpec(
                "TCP retransmissions during the probe",
                {"retransmitted": names.LINK_RETRANSMIT_RATIO},
                "share of segments",
                from_zero=True,
            ),
            ChartSpec(
                "Utilisation against the ceiling",
                {"utilisation": names.LINK_UTILIZATION},
                "share of link",
                limits={"ceiling": link.utilization_ceiling},
                from_zero=True,
            ),
        ],
    )
    last_probe = latest(subject=link, name=names.LINK_MEASURED_MBIT_S)
    return render(
        request,
        "inventory/link_detail.html",
        {"link": link, "charts": charts, "last_probe": last_probe[1] if last_probe else None},
    )


def config_events(link: Link, since: datetime) -> list[tuple[datetime, str]]:
    """The config versions, since ``since``, of the deployments that send KV over ``link``
    (a prefill pool at its source, a decode pool at its destination): the chart markers that
    tell "the link changed" from "the configuration changed"."""
    snapshots = (
        ConfigSnapshot.objects.filter(
            deployment__pools__role="prefill",
            deployment__pools__site=link.from_site_id,
            created_at__gte=since,
        )
        .filter(deployment__pools__role="decode", deployment__pools__site=link.to_site_id)
        .select_related("deployment")
        .distinct()
        .order_by("-created_at")[:MAX_EVENTS]
    )
    return [(s.created_at, f"{s.deployment.name} v{s.version}") for s in reversed(snapshots)]


@page_view
@require_GET
def node_log(request: HttpRequest, pk: int, child: str) -> HttpResponse:
    """One supervised process's log, read through the node's agent: the last ``size`` bytes
    (before ``before``), the lines containing ``q`` when given. Operators only: a log can
    hold what a trace does not (addresses, error texts)."""
    if not user_has_role(request.user, Role.OPERATOR):
        raise PermissionDenied("Reading a node's logs needs the operator role.")
    node = get_object_or_404(Node.objects.select_related("site"), pk=pk)
    query = LogQuerySerializer(data=request.GET)
    valid = query.is_valid()
    params = query.validated_data if valid else {}
    context = {
        "node": node,
        "child": child,
        "search": params.get("q", request.GET.get("q", "")),
        "size": params.get("size", agentlogs.DEFAULT_SIZE),
        "sizes": list(agentlogs.SIZES),
        "children": agentlogs.process_names(node.reported_children),
        "error": "",
    }
    if not agentlogs.CHILD_NAME.match(child):
        context["error"] = "child: not a process name (letters, digits, '.', '_', '-')"
    elif not valid:
        field, messages = next(iter(query.errors.items()))
        context["error"] = f"{field}: {messages[0]}"
    if context["error"]:
        return render(request, "inventory/node_log.html", context, status=400)
    try:
        context["log"] = agentlogs.read_log(
            address=node.agent_address,
            hostname=node.hostname,
            child=child,
            size=agentlogs.SIZES[params["size"]],
            before=params.get("before"),
            search=params["q"],
        )
    except agentlogs.LogUnavailable as exc:
        context["error"] = exc.message
        return render(request, "inventory/node_log.html", context, status=exc.status)
    return render(request, "inventory/node_log.html", context)
