"""Drill pages: the drills of every (or one) deployment with their latest report and a "run
drill" button for operators (an htmx POST to the drills API's ``run`` action, so it is
audited and conflict-checked by ``console.drills.services``), and one report with its
timeline chart, TTFT per window, detect / recover times, verification and criteria."""

from __future__ import annotations

from typing import Any

from django.db.models import F, Prefetch, Window
from django.db.models.functions import RowNumber
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from console.core.pages import page_view, paginate
from console.deployments.models import Deployment
from console.drills import selectors
from console.drills.charts import timeline_chart
from console.drills.choices import ReportState
from console.drills.models import Drill, DrillReport
from console.drills.services import run_ended_text
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
    if raw.isdigit():
        deployment = get_object_or_404(Deployment, pk=int(raw))
        drills = drills.filter(deployment=deployment)
    page = paginate(request, drills)
    for drill in page.object_list:
        drill.recent_reports = list(drill.reports.all())
    return render(request, "drills/drill_list.html", {"page": page, "deployment": deployment})


def _ttft_rows(ttft: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per path (``all`` first) with p50 / p99 / n for each window."""
    paths = sorted({p for w in WINDOWS for p in (ttft.get(w) or {})}, key=lambda p: (p != "all", p))
    return [
        {"path": path, "windows": [(ttft.get(w) or {}).get(path) or {} for w in WINDOWS]}
        for path in paths
    ]


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
