from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness and database reachability, for load balancers and the testbed (no auth)."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return JsonResponse({"status": "ok", "database": "ok"})
    except Exception as exc:  # any database failure means "not ready"
        return JsonResponse({"status": "error", "database": type(exc).__name__}, status=503)


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    """The landing page. The full overview (sites, links, deployments) is the console issue's."""
    return render(request, "core/overview.html", {})
