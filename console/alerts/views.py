"""Alert pages: what fires now (loudest first, with acknowledge for operators), the history
with filters, the rules (threshold and on/off editable by operators, through the same audited
services as the API) and the notification channels (operators only, as in the API)."""

from __future__ import annotations

import math
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import Case, IntegerField, QuerySet, Value, When
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET
from rest_framework.exceptions import APIException

from console.alerts.choices import LEVEL_RANK, AlertLayer, AlertLevel, AlertState
from console.alerts.models import Alert, AlertRule, NotificationChannel
from console.alerts.services import alert_acknowledge, alert_rule_update
from console.core.choices import Role
from console.core.pages import action_view, page_view, paginate
from console.core.roles import user_has_role

#: The history filters the page offers, each with its allowed values (anything else: ignored
#: with a message, never a 500).
FILTERS = {
    "state": [c.value for c in AlertState],
    "level": [c.value for c in AlertLevel],
    "layer": [c.value for c in AlertLayer],
}


def _loudest_first(alerts: QuerySet[Alert]) -> QuerySet[Alert]:
    rank = Case(
        *(When(level=level, then=Value(r)) for level, r in LEVEL_RANK.items()),
        default=Value(-1),
        output_field=IntegerField(),
    )
    return alerts.annotate(rank=rank).order_by("-rank", "started_at", "id")


def _filtered(request: HttpRequest) -> tuple[QuerySet[Alert], dict[str, str], list[str]]:
    history = Alert.objects.select_related("acknowledged_by")
    chosen, problems = {}, []
    for key, allowed in FILTERS.items():
        value = request.GET.get(key, "")
        if not value:
            continue
        if value not in allowed:
            problems.append(f"{key}: {value!r} is not one of {', '.join(allowed)}")
            continue
        chosen[key] = value
        history = history.filter(**{key: value})
    rule = request.GET.get("rule", "")
    if rule:
        chosen["rule"] = rule
        history = history.filter(rule_name=rule)
    return history.order_by("-started_at", "-id"), chosen, problems


@page_view
@require_GET
def alert_list(request: HttpRequest) -> HttpResponse:
    """Firing alerts, the filtered history (paginated), the rules and, for operators, the
    notification channels."""
    firing = list(
        _loudest_first(
            Alert.objects.filter(state=AlertState.FIRING).select_related("acknowledged_by")
        )
    )
    history, chosen, problems = _filtered(request)
    can_operate = user_has_role(request.user, Role.OPERATOR)
    context: dict[str, Any] = {
        "firing": firing,
        "page": paginate(request, history),
        "chosen": chosen,
        "problems": problems,
        "filters": [(key, values, chosen.get(key, "")) for key, values in FILTERS.items()],
        "rules": AlertRule.objects.order_by("layer", "name"),
        "rule_names": AlertRule.objects.order_by("name").values_list("name", flat=True),
        "channels": NotificationChannel.objects.order_by("name") if can_operate else None,
    }
    return render(request, "alerts/alert_list.html", context)


def _error_text(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
    return str(getattr(exc, "detail", exc))


@action_view(Role.OPERATOR)
def alert_acknowledge_action(request: HttpRequest, pk: int) -> HttpResponse:
    """Acknowledge one firing alert; answers the alert's row (htmx swaps it in place), with
    the refusal in it when the alert resolved or someone else acknowledged it first."""
    alert = get_object_or_404(Alert, pk=pk)
    error = ""
    try:
        alert = alert_acknowledge(
            actor=request.user, alert=alert, note=request.POST.get("note", "")
        )
    except (APIException, ValidationError) as exc:
        alert.refresh_from_db()
        error = _error_text(exc)
    return render(
        request,
        "alerts/_firing_row.html",
        {"a": alert, "error": error, "can_operate": True},
        status=200 if not error else 409,
    )


@action_view(Role.OPERATOR)
def alert_rule_edit_action(request: HttpRequest, pk: int) -> HttpResponse:
    """Change one rule's threshold and on/off (the audited ``alert_rule_update``); answers the
    rule's row with a per-field message on a bad value."""
    rule = get_object_or_404(AlertRule, pk=pk)
    error, raw = "", request.POST.get("threshold", "").strip()
    try:
        threshold = float(raw)
        if not math.isfinite(threshold):
            raise ValueError(raw)
    except ValueError:
        error = f"threshold: {raw!r} is not a finite number"
    else:
        try:
            rule = alert_rule_update(
                actor=request.user,
                rule=rule,
                threshold=threshold,
                enabled=request.POST.get("enabled") == "on",
            )
        except (APIException, ValidationError) as exc:
            rule.refresh_from_db()
            error = _error_text(exc)
    return render(
        request,
        "alerts/_rule_row.html",
        {"rule": rule, "error": error, "saved": not error, "can_operate": True},
        status=200 if not error else 400,
    )
