"""Request trace pages: recent traces (find one by request id) and one request's legs as a
bar timeline on the console's clock, with where each leg's process logged it. Reads only."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET

from console.core.choices import Role
from console.core.pages import page_view, paginate
from console.core.roles import user_has_role
from console.telemetry.models import RequestTrace
from console.telemetry.traces import trace_timeline, traces_for


@page_view
@require_GET
def trace_list(request: HttpRequest) -> HttpResponse:
    """Recent traces, newest first; ``?request_id=`` opens that request's trace (the newest
    when several gateways or retries recorded one)."""
    request_id = (request.GET.get("request_id") or "").strip()
    traces = RequestTrace.objects.select_related("node__site")
    if request_id:
        found = traces_for(request_id)
        if found.count() == 1:
            return redirect("trace-page", pk=found.first().pk)  # type: ignore[union-attr]
        traces = found
    path = request.GET.get("path") or ""
    if path:
        traces = traces.filter(path=path)
    return render(
        request,
        "telemetry/trace_list.html",
        {"page": paginate(request, traces), "request_id": request_id, "path": path},
    )


@page_view
@require_GET
def trace_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One request's legs on the console's clock, and each process's log location."""
    trace = get_object_or_404(RequestTrace.objects.select_related("node__site"), pk=pk)
    context = trace_timeline(trace)
    context["can_read_logs"] = user_has_role(request.user, Role.OPERATOR)
    return render(request, "telemetry/trace_detail.html", context)
