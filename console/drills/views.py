"""Drill pages: the drills of every (or one) deployment with their latest report and a "run
drill" button for operators (an htmx POST to the drills API's ``run`` action, so it is
audited and conflict-checked by ``console.drills.services``), one drill's definition and
reports, the create / edit form for operators (``DrillForm`` through ``drill_create`` /
``drill_update``, the API's services: same checks, same audit entry; a refusal is a message
on the field it names), and one report with its timeline chart, TTFT per window, detect /
recover times, verification and criteria."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db.models import F, Prefetch, Window
from django.db.models.functions import RowNumber
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods

from console.core.choices import Role
from console.core.forms import save_through
from console.core.pages import action_view, is_id, page_view, paginate
from console.core.roles import user_has_role
from console.deployments.models import Deployment
from console.drills import selectors, services
from console.drills.charts import timeline_chart
from console.drills.choices import ReportState
from console.drills.criteria import criteria_defaults
from console.drills.forms import DrillForm
from console.drills.models import Drill, DrillReport
from console.drills.services import LOAD_DEFAULTS, run_ended_text
from console.runs.choices import RUN_TERMINAL

#: The report's windows, by request start (``orchestrator.workflows.drill_figures.WINDOWS``).
WINDOWS = ("before", "during", "after")
#: Reports shown per drill on the list (the report pages hold the rest).
RECENT_REPORTS = 5


@page_view
@require_GET
def drill_list(request: HttpRequest) -> HttpResponse:
    """Drills (``?deployment=<id>`` for one deployment's) with their latest reports."""
    # Only the latest reports of each drill are fetched (a window in SQL), however many exist.
    latest = DrillReport.objects.annotate(
        rank=Window(
            RowNumber(),
            partition_by=[F("drill_id")],
            order_by=[F("created_at").desc(), F("id").desc()],
        )
    ).filter(rank__lte=RECENT_REPORTS)
    drills = selectors.drill_list().prefetch_related(
        Prefetch("reports", queryset=latest.order_by("-created_at", "-id"))
    )
    deployment = None
    raw = request.GET.get("deployment", "")
    if is_id(raw):
        deployment = get_object_or_404(Deployment, pk=int(raw))
        drills = drills.filter(deployment=deployment)
    page = paginate(request, drills)
    for drill in page.object_list:
        drill.recent_reports = list(drill.reports.all())
    return render(request, "drills/drill_list.html", {"page": page, "deployment": deployment})


@page_view
@require_GET
def drill_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One drill: its definition (criteria with their defaults, target overrides, load,
    schedule) and its reports, newest first."""
    drill = get_object_or_404(selectors.drill_list(), pk=pk)
    criteria = [
        (key, (drill.criteria or {}).get(key, default), key not in (drill.criteria or {}))
        for key, default in criteria_defaults(drill.site).items()
    ]
    load = [
        (key, (drill.load_profile or {}).get(key, default), key not in (drill.load_profile or {}))
        for key, default in LOAD_DEFAULTS.items()
    ]
    return render(
        request,
        "drills/drill_detail.html",
        {
            "drill": drill,
            "criteria": criteria,
            "load": load,
            "page": paginate(request, drill.reports.select_related("run")),
        },
    )


def _operator_form(request: HttpRequest) -> None:
    """Viewers see no forms: the form page itself answers 403 as its POST does."""
    if not user_has_role(request.user, Role.OPERATOR):
        raise PermissionDenied(f"This needs the {Role.OPERATOR.value} role.")


@page_view
@require_http_methods(["GET", "POST"])
def drill_new(request: HttpRequest) -> HttpResponse:
    """The create form (``?deployment=<id>`` preselects the deployment)."""
    if request.method == "POST":
        return _drill_save(request, None)
    _operator_form(request)
    raw = request.GET.get("deployment", "")
    form = DrillForm(initial={"deployment": int(raw)} if is_id(raw) else {})
    return render(request, "drills/drill_form.html", {"form": form, "drill": None})


@page_view
@require_http_methods(["GET", "POST"])
def drill_edit(request: HttpRequest, pk: int) -> HttpResponse:
    """The edit form of one drill."""
    if request.method == "POST":
        return _drill_save(request, pk)
    _operator_form(request)
    drill = get_object_or_404(Drill, pk=pk)
    return render(
        request, "drills/drill_form.html", {"form": DrillForm(drill=drill), "drill": drill}
    )


@action_view(Role.OPERATOR)
def _drill_save(request: HttpRequest, pk: int | None) -> HttpResponse:
    """Create or change a drill through the services; back to the drill's page with a
    message, or the form again (400) with each refusal on its field."""
    drill = get_object_or_404(Drill, pk=pk) if pk is not None else None
    form = DrillForm(request.POST, drill=drill)
    saved = save_through(
        form, actor=request.user, create=services.drill_create, update=services.drill_update,
        instance=drill, instance_kwarg="drill", aliases=DrillForm.ALIASES,
    )  # fmt: skip
    if saved is None:
        if drill is not None:
            drill.refresh_from_db()
        return render(request, "drills/drill_form.html", {"form": form, "drill": drill}, status=400)
    verb = "created" if drill is None else "saved"
    messages.success(request, f"Drill {saved.name} {verb}.")
    return HttpResponseRedirect(reverse("drill-page", args=[saved.pk]))


def _ttft_rows(ttft: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per path (``all`` first) with p50 / p99 / n for each window."""
    paths = sorted({p for w in WINDOWS for p in (ttft.get(w) or {})}, key=lambda p: (p != "all", p))
    return [
        {"path": path, "windows": [(ttft.get(w) or {}).get(path) or {} for w in WINDOWS]}
        for path in paths
    ]


def _site_rows(sites: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per prefill site with its remote answers in each window (the faulted site
    first), then one per failover ``from->to``: where the traffic went during the fault."""
    served, failovers = sites.get("served") or {}, sites.get("failovers") or {}
    faulted = sites.get("faulted") or ""
    names = set(sites.get("prefill_sites") or []) | {
        s for w in WINDOWS for s in served.get(w) or {}
    }
    rows = [
        {
            "key": name,
            "faulted": name == faulted,
            "counts": [(served.get(w) or {}).get(name, 0) for w in WINDOWS],
        }
        for name in sorted(names, key=lambda n: (n != faulted, n))
    ]
    keys = sorted({k for w in WINDOWS for k in failovers.get(w) or {}})
    rows += [
        {
            "key": f"failover {key}",
            "faulted": False,
            "counts": [(failovers.get(w) or {}).get(key, 0) for w in WINDOWS],
        }
        for key in keys
    ]
    return rows


def _requests_rows(requests: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per ``path/outcome`` with its count in each window."""
    keys = sorted({k for w in WINDOWS for k in (requests.get(w) or {})})
    return [
        {"key": key, "counts": [(requests.get(w) or {}).get(key, 0) for w in WINDOWS]}
        for key in keys
    ]


@page_view
@require_GET
def report_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One drill report: the verdict and each criterion, the requests-by-path timeline with
    the fault window shaded, TTFT before / during / after, detect and recover times,
    breaker, verification and the failed requests."""
    report = get_object_or_404(
        DrillReport.objects.select_related("drill__deployment", "run"), pk=pk
    )
    drill: Drill = report.drill
    return render(
        request,
        "drills/report_detail.html",
        {
            "report": report,
            "drill": drill,
            "windows": WINDOWS,
            "chart": timeline_chart(report.timeline or {}),
            "ttft_rows": _ttft_rows(report.ttft or {}),
            "requests_rows": _requests_rows(report.requests or {}),
            "site_rows": _site_rows(report.sites or {}),
            "marks": (report.timeline or {}).get("marks") or {},
            "ended_early": (
                run_ended_text(report)
                if report.state == ReportState.RUNNING
                and report.run is not None
                and report.run.state in RUN_TERMINAL
                else ""
            ),
        },
    )
