"""Tidal pages: every tidal schedule, and one schedule's 24-hour plan from the what-if
service (``services.tidal_inputs`` + ``policy.day_plan``, the same as ``GET
/api/tidal-schedules/<id>/what-if/``; nothing is written): prices per site by hour, the
planned remote instances and remote share by hour against the capacity window, and the cost
per million tokens against the all-local and always-remote schedules, and the recorded
traffic of the last days priced with and without the schedule (``selectors.
tidal_recorded_cost``, the same as ``GET /api/tidal-schedules/<id>/recorded-cost/``). Blocking (the plan
sweeps the planner grid per candidate count); a schedule whose inputs do not plan shows the
field at fault instead of an error page. Operators create and edit schedules and each site's
hourly price table here (``TidalScheduleForm`` / ``PriceTableForm`` through the API's
services: the same checks and audit entry; a refusal marks the input, or the hour, it
names); price tables save in place with htmx."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods

from console.core.charts import _html, xy_chart
from console.core.choices import Role
from console.core.forms import save_through
from console.core.pages import action_view, is_id, page_view, paginate
from console.core.roles import user_has_role
from console.inventory.models import Site
from console.schedules import policy, selectors, services
from console.schedules.charts import recorded_cost_chart
from console.schedules.forms import PriceTableForm, TidalScheduleForm
from console.schedules.models import SitePriceTable, TidalSchedule

HOURS = list(range(24))
BASELINES = (
    ("tidal", "tidal plan"),
    ("all_local", "all local"),
    ("always_remote", "always remote"),
)


def _schedules() -> Any:
    return TidalSchedule.objects.select_related("deployment", "remote_site", "local_site")


@page_view
@require_GET
def tidal_list(request: HttpRequest) -> HttpResponse:
    """Tidal schedules, one per deployment; ``?deployment=<id>`` (the deployment page's link)
    goes straight to that deployment's schedule, or says it has none."""
    schedules = _schedules()
    raw = request.GET.get("deployment", "")
    if is_id(raw):
        schedules = schedules.filter(deployment_id=int(raw))
        mine = schedules.first()
        if mine is not None:
            return HttpResponseRedirect(reverse("tidal-page", args=[mine.pk]))
    return render(
        request,
        "schedules/tidal_list.html",
        {"page": paginate(request, schedules), "filtered": is_id(raw)},
    )


def plan_chart(plan: dict[str, Any], capacity: list[int]) -> str:
    """Planned remote instances per hour (bars) against the capacity window, and the share
    of requests prefilled remotely (line, right axis)."""
    import plotly.graph_objects as go  # heavy import, only for pages that draw

    hours = plan["hours"]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(x=HOURS, y=[h["remote_instances"] for h in hours], name="remote instances")
    )
    fig.add_trace(
        go.Scatter(
            x=HOURS,
            y=capacity,
            name="capacity",
            mode="lines",
            line={"shape": "hvh", "dash": "dash", "color": "#6e7781"},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=HOURS,
            y=[round(100 * (h["offload_share"] or 0.0), 1) for h in hours],
            name="remote share of requests %",
            mode="lines+markers",
            yaxis="y2",
            line={"color": "#1f6feb"},
        )
    )
    fig.update_layout(
        title={"text": "Planned remote prefill", "font": {"size": 14}},
        xaxis={"title": "hour of day", "dtick": 2},
        yaxis={"title": "instances", "rangemode": "tozero"},
        yaxis2={"title": "%", "overlaying": "y", "side": "right", "range": [0, 100]},
        height=300,
        margin={"l": 55, "r": 55, "t": 40, "b": 40},
        legend={"orientation": "h", "y": -0.25},
        template="plotly_white",
    )
    return _html(fig)


def _cost_rows(plan: dict[str, Any]) -> list[dict[str, Any]]:
    totals = plan["totals"]
    saving = {"all_local": plan["saving"]["vs_all_local"]}
    saving["always_remote"] = plan["saving"]["vs_always_remote"]
    return [
        {"key": key, "label": label, **totals[key], "tidal_saving": saving.get(key)}
        for key, label in BASELINES
    ]


def recorded_days(request: HttpRequest) -> tuple[int, str]:
    """``?days=`` of the recorded-cost section (default 7, 1-31) and an error naming it."""
    raw = request.GET.get("days", "").strip()
    if not raw:
        return selectors.DEFAULT_DAYS, ""
    if raw.isdigit() and 1 <= int(raw) <= selectors.MAX_DAYS:
        return int(raw), ""
    return selectors.DEFAULT_DAYS, f"days: must be a whole number from 1 to {selectors.MAX_DAYS}"


def recorded_context(
    request: HttpRequest,
    schedule: TidalSchedule,
    inputs: policy.TidalInputs | None = None,
    query: str = "",
) -> tuple[dict[str, Any], int]:
    """The recorded-cost section (``schedules/_recorded_cost.html``, on the tidal page and the
    planner page): its answer and chart, or the error naming the field (status 400 for a bad
    ``?days=``). ``query`` is kept in the section's day links (the planner's ``tidal=<id>&``)."""
    days, error = recorded_days(request)
    context: dict[str, Any] = {
        "recorded_days": days,
        "recorded_choices": (1, 7, 14, 31),
        "recorded_query": query,
        "recorded_schedule": schedule,
    }
    if error:
        return {**context, "recorded_error": error}, 400
    try:
        recorded = selectors.tidal_recorded_cost(schedule=schedule, days=days, inputs=inputs)
    except ValidationError as exc:  # a stored input that no longer validates, by field
        message = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
        return {**context, "recorded_error": message}, 200
    except ValueError as exc:  # recorded.check_inputs names the table
        return {**context, "recorded_error": str(exc)}, 200
    context.update(recorded=recorded, recorded_chart=recorded_cost_chart(recorded))
    return context, 200


@page_view
@require_GET
def tidal_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One schedule's day: price, plan and cost charts and the cost comparison table."""
    schedule = get_object_or_404(_schedules(), pk=pk)
    context: dict[str, Any] = {"schedule": schedule, "error": None}
    try:
        inputs = services.tidal_inputs(schedule)
        plan = policy.day_plan(inputs)
    except ValidationError as exc:  # a stored input that no longer validates, by field
        context["error"] = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
        return render(request, "schedules/tidal_detail.html", context)
    except ValueError as exc:  # policy.check_inputs names the table
        context["error"] = str(exc)
        return render(request, "schedules/tidal_detail.html", context)
    context.update(
        plan=plan,
        price_chart=xy_chart(
            title="GPU-hour price per site",
            lines={
                f"{schedule.remote_site.name} (remote)": (HOURS, inputs.remote_prices),
                f"{schedule.local_site.name} (local)": (HOURS, inputs.local_prices),
            },
            x_title=f"hour of day ({schedule.timezone})",
            y_title="price / GPU-hour",
            height=280,
            step=True,
        ),
        plan_chart=plan_chart(plan, list(inputs.capacity)),
        cost_chart=xy_chart(
            title="Cost per million tokens by hour",
            lines={
                label: (HOURS, [h["cost_per_million_tokens"] for h in plan[key]])
                for key, label in (
                    ("hours", "tidal plan"),
                    ("all_local", "all local"),
                    ("always_remote", "always remote"),
                )
            },
            x_title="hour of day",
            y_title="cost / M tokens",
            height=280,
            step=True,
        ),
        cost_rows=_cost_rows(plan),
        hours=plan["hours"],
    )
    recorded, status = recorded_context(request, schedule, inputs)
    context.update(recorded)
    return render(request, "schedules/tidal_detail.html", context, status=status)


def _operator_form(request: HttpRequest) -> None:
    """Viewers see no forms: the form page itself answers 403 as its POST does."""
    if not user_has_role(request.user, Role.OPERATOR):
        raise PermissionDenied(f"This needs the {Role.OPERATOR.value} role.")


@page_view
@require_http_methods(["GET", "POST"])
def tidal_new(request: HttpRequest) -> HttpResponse:
    """The create form, starting from the planner's case-study scenario (``?deployment=<id>``
    preselects the deployment)."""
    if request.method == "POST":
        return _tidal_save(request, None)
    _operator_form(request)
    raw = request.GET.get("deployment", "")
    form = TidalScheduleForm(initial={"deployment": int(raw)} if is_id(raw) else {})
    return render(request, "schedules/tidal_form.html", {"form": form, "schedule": None})


@page_view
@require_http_methods(["GET", "POST"])
def tidal_edit(request: HttpRequest, pk: int) -> HttpResponse:
    """The edit form of one schedule."""
    if request.method == "POST":
        return _tidal_save(request, pk)
    _operator_form(request)
    schedule = get_object_or_404(_schedules(), pk=pk)
    form = TidalScheduleForm(schedule=schedule)
    return render(request, "schedules/tidal_form.html", {"form": form, "schedule": schedule})


@action_view(Role.OPERATOR)
def _tidal_save(request: HttpRequest, pk: int | None) -> HttpResponse:
    """Create or change a schedule through the services; to its plan with a message, or the
    form again (400) with each refusal on its input or hour."""
    schedule = get_object_or_404(_schedules(), pk=pk) if pk is not None else None
    form = TidalScheduleForm(request.POST, schedule=schedule)
    saved = save_through(
        form, actor=request.user, create=services.tidal_schedule_create,
        update=services.tidal_schedule_update, instance=schedule, instance_kwarg="schedule",
    )  # fmt: skip
    if saved is None:
        if schedule is not None:
            schedule.refresh_from_db()
        context = {"form": form, "schedule": schedule}
        return render(request, "schedules/tidal_form.html", context, status=400)
    verb = "created" if schedule is None else "saved"
    messages.success(request, f"Tidal schedule of {saved.deployment.name} {verb}.")
    return HttpResponseRedirect(reverse("tidal-page", args=[saved.pk]))


def _price_forms(bound: PriceTableForm | None = None) -> list[PriceTableForm]:
    tables = {t.site_id: t for t in SitePriceTable.objects.all()}
    forms = []
    for site in Site.objects.order_by("name"):
        if bound is not None and bound.site.pk == site.pk:
            forms.append(bound)
        else:
            forms.append(PriceTableForm(site=site, table=tables.get(site.pk)))
    return forms


@page_view
@require_GET
def price_list(request: HttpRequest) -> HttpResponse:
    """Every site's GPU-hour price by hour of the day: its table, or its flat price every
    hour; operators edit each table in place."""
    return render(request, "schedules/price_list.html", {"forms": _price_forms()})


@action_view(Role.OPERATOR)
def price_save(request: HttpRequest, site_pk: int) -> HttpResponse:
    """Create or change one site's table (``price_table_create`` / ``_update``). htmx gets
    the site's form back (saved, or 400 with the hours refused); a plain POST goes back to
    the prices page."""
    site = get_object_or_404(Site, pk=site_pk)
    table = SitePriceTable.objects.filter(site=site).first()
    form = PriceTableForm(request.POST, site=site, table=table)
    saved = save_through(
        form, actor=request.user, create=services.price_table_create,
        update=services.price_table_update, instance=table, instance_kwarg="table", site=site,
    )  # fmt: skip
    htmx = request.headers.get("HX-Request") == "true"
    if saved is None:
        if htmx:
            context = {"form": form, "saved": False}
            return render(request, "schedules/_price_table.html", context, status=400)
        return render(
            request, "schedules/price_list.html", {"forms": _price_forms(form)}, status=400
        )
    if htmx:
        fresh = PriceTableForm(site=site, table=saved)
        return render(request, "schedules/_price_table.html", {"form": fresh, "saved": True})
    messages.success(request, f"Prices of {site.name} saved.")
    return HttpResponseRedirect(reverse("tidal-prices-page") + f"#prices-{site.pk}")
