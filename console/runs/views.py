"""Run pages: the list, one run with its steps (live through htmx polling of the steps
fragment while the run is not finished), evidence, logs, and operator actions (start a
standalone workflow, cancel, retry from a step), all through ``console.runs.services``."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_GET
from rest_framework.exceptions import APIException

from console.core.choices import Role
from console.core.pages import action_view, is_id, page_view, paginate
from console.runs import selectors, services
from console.runs.choices import RUN_TERMINAL, RunState
from console.runs.models import WorkflowRun

POLL_SECONDS = 2


@page_view
@require_GET
def run_list(request: HttpRequest) -> HttpResponse:
    """Runs, newest first, filterable by state and kind; operators start standalone workflows here."""
    runs = WorkflowRun.objects.select_related("created_by").prefetch_related("steps")
    state = request.GET.get("state", "")
    kind = request.GET.get("kind", "")
    if state in RunState.values:
        runs = runs.filter(state=state)
    if kind:
        runs = runs.filter(kind=kind)
    return render(
        request,
        "runs/run_list.html",
        {
            "page": paginate(request, runs),
            "states": RunState.values,
            "state": state,
            "kind": kind,
            "standalone": selectors.standalone_workflows(),
        },
    )


def _run_context(pk: int) -> dict[str, object]:
    run = get_object_or_404(WorkflowRun.objects.select_related("created_by"), pk=pk)
    steps = list(run.steps.order_by("index"))
    return {
        "run": run,
        "steps": steps,
        "live": run.state not in RUN_TERMINAL,
        "poll_seconds": POLL_SECONDS,
        "retryable": run.state in {RunState.FAILED, RunState.CANCELED, RunState.ROLLED_BACK},
    }


@page_view
@require_GET
def run_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One run with its steps; the steps fragment polls itself while the run is live."""
    return render(request, "runs/run_detail.html", _run_context(pk))


@page_view
@require_GET
def run_steps(request: HttpRequest, pk: int) -> HttpResponse:
    """The steps fragment the run page polls; it stops polling once the run has ended."""
    return render(request, "runs/_steps.html", _run_context(pk))


def _back(pk: int) -> HttpResponseRedirect:
    return HttpResponseRedirect(reverse("run-page", args=[pk]))


@action_view(Role.OPERATOR)
def run_start(request: HttpRequest) -> HttpResponse:
    """Form POST ``kind=<standalone workflow>``: start it and show its page."""
    kind = request.POST.get("kind", "")
    if kind not in selectors.standalone_workflows():
        messages.error(
            request, f"kind: expected one of {', '.join(selectors.standalone_workflows())}"
        )
        return HttpResponseRedirect(reverse("runs-page"))
    run = services.run_create(actor=request.user, kind=kind, steps=selectors.standalone_steps(kind))
    return _back(run.pk)


@action_view(Role.OPERATOR)
def run_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """Form POST: ask the run to stop at its next step boundary (409s become a message)."""
    run = get_object_or_404(WorkflowRun, pk=pk)
    try:
        services.run_cancel(actor=request.user, run=run)
    except APIException as exc:
        messages.error(request, str(exc.detail))
    else:
        messages.success(request, "Cancel requested: the run stops at its next step boundary.")
    return _back(pk)


@action_view(Role.OPERATOR)
def run_retry(request: HttpRequest, pk: int) -> HttpResponse:
    """Form POST ``from_step=<index>`` (optional: the failed step)."""
    run = get_object_or_404(WorkflowRun, pk=pk)
    raw = request.POST.get("from_step", "")
    if raw and not is_id(raw):
        messages.error(request, "from_step: expected a step index")
        return _back(pk)
    try:
        services.run_retry(actor=request.user, run=run, from_index=int(raw) if raw else None)
    except (APIException, ValueError) as exc:
        messages.error(request, str(getattr(exc, "detail", exc)))
    else:
        messages.success(request, "Retry queued.")
    return _back(pk)
