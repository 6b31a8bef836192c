"""The planner page: pick the case study, a saved scenario or paste a scenario body, see the
verdict, the optimum, the baselines and the charts. Server-rendered; evaluation is the same
as ``POST /api/planner/evaluate/`` (milliseconds). Any role may use it; a bad body is shown
as an error on the page (status 400), never a 500.

Below, the recorded traffic of one tidal schedule (``?tidal=<id>``, else the first by
deployment name) priced with and without the schedule, as on that schedule's page
(``console.schedules.views.recorded_context``; ``?days=`` 1-31, default 7): a bounded number
of queries whatever the number of schedules or samples."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from console.core.choices import Role
from console.core.pages import is_id
from console.core.roles import user_has_role
from console.planner.charts import split_chart, threshold_chart
from console.planner.errors import PlannerInputError
from console.planner.inputs import parse_scenario
from console.planner.model import evaluate
from console.planner.models import PlannerScenario
from console.planner.presets import PRESETS, preset_scenario
from console.planner.selectors import scenario_resolve
from console.schedules.models import TidalSchedule
from console.schedules.views import recorded_context

DEFAULT_PRESET = "prfaas-case-study"
MAX_BODY_CHARS = 2_500_000
MAX_TIDAL_LINKS = 50  # schedules named in the recorded-cost picker


def _tidal_section(request: HttpRequest) -> tuple[dict[str, Any], int]:
    """The recorded-cost section: the schedules to pick from and the picked one's answer."""
    schedules = list(
        TidalSchedule.objects.select_related("deployment", "remote_site", "local_site").order_by(
            "deployment__name", "pk"
        )[:MAX_TIDAL_LINKS]
    )
    raw = request.GET.get("tidal", "")
    picked = next((s for s in schedules if is_id(raw) and s.pk == int(raw)), None)
    if picked is None and is_id(raw):
        picked = (
            TidalSchedule.objects.select_related("deployment", "remote_site", "local_site")
            .filter(pk=int(raw))
            .first()
        )
    picked = picked or (schedules[0] if schedules else None)
    context: dict[str, Any] = {"tidal_schedules": schedules, "tidal_picked": picked}
    if picked is None:
        return context, 200
    section, status = recorded_context(request, picked, query=f"tidal={picked.pk}&")
    return {**context, **section}, status


def _initial_body(request: HttpRequest) -> tuple[Any, str]:
    """The body to show: ``?scenario=<id>``, ``?preset=<name>`` or the case study."""
    scenario_id = request.GET.get("scenario", "")
    if is_id(scenario_id):
        saved = PlannerScenario.objects.filter(pk=int(scenario_id)).first()
        if saved is not None:
            return saved.body, f"saved scenario {saved.name}"
    name = request.GET.get("preset", DEFAULT_PRESET)
    if name not in PRESETS:
        name = DEFAULT_PRESET
    return preset_scenario(name), PRESETS[name]["title"]


@login_required
@require_http_methods(["GET", "POST"])
def planner_page(request: HttpRequest) -> HttpResponse:
    if not user_has_role(request.user, Role.VIEWER):
        raise PermissionDenied("Your role does not allow this.")
    error = ""
    if request.method == "POST":
        text = request.POST.get("body", "")
        label = "submitted scenario"
        body: Any = None
        if len(text) > MAX_BODY_CHARS:
            error = f"body: at most {MAX_BODY_CHARS} characters"
        else:
            try:
                body = json.loads(text)
            except ValueError as exc:
                error = f"body: not valid JSON ({exc})"
    else:
        body, label = _initial_body(request)
        text = json.dumps(body, indent=2)
    result = None
    if not error:
        try:
            resolved, _ = scenario_resolve(body)
            result = evaluate(parse_scenario(resolved), with_sweeps=True)
        except PlannerInputError as exc:
            error = f"{exc.field}: {exc.message}" if exc.field else exc.message
    tidal, tidal_status = _tidal_section(request)
    context = {
        **tidal,
        "label": label,
        "body_text": text,
        "error": error,
        "result": result,
        "presets": [(name, preset["title"]) for name, preset in PRESETS.items()],
        "saved": PlannerScenario.objects.order_by("name").only("id", "name")[:200],
        "threshold_chart": threshold_chart(result) if result else "",
        "split_chart": split_chart(result) if result else "",
    }
    status = 400 if error else tidal_status
    return render(request, "planner/planner.html", context, status=status)
