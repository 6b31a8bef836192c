"""Canary pages: every canary run, and one canary with its share over time (a step chart),
each gate's measurements per step against its limit, the rollback reason, and pause / resume
/ abort buttons for operators (htmx POSTs to the deployment API's ``canary/*`` actions, so
``console.deployments.flows`` audits and conflict-checks them). Pure reads of the run and its
steps; the step evidence is what ``orchestrator.workflows.canary`` records."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from console.core.charts import _html, empty_chart, time_chart
from console.core.choices import Role
from console.core.pages import is_id, page_view, paginate
from console.core.roles import user_has_role
from console.deployments.flows import CANARY_KIND
from console.deployments.models import Deployment
from console.runs.choices import RUN_TERMINAL, RunState
from console.runs.models import StepRun, WorkflowRun

#: Gates in the order the workflow evaluates them (``canary.evaluate_gates``).
GATES = ("ttft_p50_ratio", "ttft_p99_ratio", "success_rate", "link_utilization")
_TARGET_TYPE = "deployments.deployment"


def _share(step: StepRun) -> int | None:
    raw = step.name.removeprefix("share_")
    return int(raw) if is_id(raw) else None


def share_series(run: WorkflowRun, steps: list[StepRun]) -> list[tuple[datetime, float]]:
    """The remote share the canary set, as (moment, percent) points: each step's share from
    when it started, 0 % when it rolled back or was aborted."""
    points: list[tuple[datetime, float]] = []
    for step in steps:
        share = _share(step)
        if step.started_at is None or share is None:
            continue
        points.append((step.started_at, float(share)))
        if step.finished_at is not None and "failed_gate" in (step.evidence or {}):
            points.append((step.finished_at, 0.0))
    if points and run.state == RunState.CANCELED and run.finished_at is not None:
        points.append((run.finished_at, 0.0))  # abort sets the share to 0 %
    elif points and run.finished_at is not None and points[-1][0] < run.finished_at:
        points.append((run.finished_at, points[-1][1]))  # hold the last share to the end
    return points


def gate_rows(steps: list[StepRun]) -> dict[str, list[dict[str, Any]]]:
    """Per gate, its judgement at each step that was gated (``{"step", "value", "limit",
    "passed", "note"}``); a step that rolled back on its hold shows the ``hold`` gate."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for step in steps:
        evidence = step.evidence or {}
        judged = list(evidence.get("gates") or [])
        failed = evidence.get("failed_gate")
        if failed and all(g.get("gate") != failed.get("gate") for g in judged):
            judged.append(failed)
        for gate in judged:
            rows.setdefault(str(gate.get("gate")), []).append({"step": step.name, **gate})
    ordered = {g: rows.pop(g) for g in GATES if g in rows}
    return {**ordered, **rows}


def gate_chart(gate: str, rows: list[dict[str, Any]]) -> str:
    """One gate's measured value per step (markers) against its limit (dashed line)."""
    measured = [r for r in rows if r.get("value") is not None]
    if not measured:
        return empty_chart(gate, "Gates are judged when a step's hold is over.")
    import plotly.graph_objects as go  # heavy import, only for pages that draw

    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=[r["step"] for r in measured],
            y=[r["value"] for r in measured],
            name="measured",
            mode="lines+markers",
            marker={
                "size": 9,
                "color": ["#2da44e" if r.get("passed") else "#cf222e" for r in measured],
            },
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[r["step"] for r in measured],
            y=[r["limit"] for r in measured],
            name="limit",
            mode="lines",
            line={"dash": "dash", "color": "#cf222e"},
        )
    )
    fig.update_layout(
        title={"text": gate, "font": {"size": 14}},
        height=240,
        margin={"l": 55, "r": 15, "t": 40, "b": 35},
        legend={"orientation": "h", "y": -0.3},
        template="plotly_white",
        xaxis={"type": "category"},
    )
    return _html(fig)


def _canaries() -> Any:
    return WorkflowRun.objects.filter(kind=CANARY_KIND).select_related("created_by")


@page_view
@require_GET
def canary_list(request: HttpRequest) -> HttpResponse:
    """Canary runs, newest first (``?deployment=<id>`` for one deployment's)."""
    runs = _canaries().prefetch_related("steps").order_by("-id")
    raw = request.GET.get("deployment", "")
    if is_id(raw):
        runs = runs.filter(target_type=_TARGET_TYPE, target_id=raw)
    page = paginate(request, runs)
    ids = {int(r.target_id) for r in page.object_list if r.target_id.isdigit()}
    names = dict(Deployment.objects.filter(pk__in=ids).values_list("pk", "name"))
    for run in page.object_list:
        run.deployment_name = names.get(int(run.target_id)) if is_id(run.target_id) else None
    return render(request, "deployments/canary_list.html", {"page": page})


def _canary_and_deployment(pk: int) -> tuple[WorkflowRun, Deployment | None]:
    run = _canaries().filter(pk=pk).first()
    if run is None:
        raise Http404("No canary run with this id.")
    deployment = (
        Deployment.objects.filter(pk=int(run.target_id)).first() if is_id(run.target_id) else None
    )
    return run, deployment


def _button_state(run: WorkflowRun) -> dict[str, Any]:
    return {"live": run.state not in RUN_TERMINAL, "paused": bool((run.params or {}).get("paused"))}


@page_view
@require_GET
def canary_actions(request: HttpRequest, pk: int) -> HttpResponse:
    """The canary's operator buttons alone (Pause or Resume, Abort) as they are now: the page
    reloads them after each action and while the run is live."""
    run, deployment = _canary_and_deployment(pk)
    if deployment is None or not user_has_role(request.user, Role.OPERATOR):
        return HttpResponse("")
    context = {"run": run, "deployment": deployment, **_button_state(run)}
    return render(request, "deployments/_canary_actions.html", context)


@page_view
@require_GET
def canary_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One canary: share step chart, gate charts and table, rollback reason, operator buttons."""
    run, deployment = _canary_and_deployment(pk)
    steps = list(run.steps.order_by("index"))
    gates = gate_rows(steps)
    failed_gate = next(
        (s.evidence["failed_gate"] for s in steps if "failed_gate" in (s.evidence or {})), None
    )
    share_chart = time_chart(
        title="Remote share",
        lines={"remote share %": share_series(run, steps)},
        y_title="%",
        hint="The share appears once the first step starts.",
        step=True,
        from_zero=True,
    )
    return render(
        request,
        "deployments/canary_detail.html",
        {
            "run": run,
            "deployment": deployment,
            "steps": steps,
            "share_chart": share_chart,
            "gates": [
                {"name": name, "rows": rows, "chart": gate_chart(name, rows)}
                for name, rows in gates.items()
            ],
            "failed_gate": failed_gate,
            **_button_state(run),
            "plan": (run.params or {}).get("plan") or {},
        },
    )
