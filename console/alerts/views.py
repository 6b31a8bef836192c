"""Alert pages: what fires now (loudest first, with acknowledge for operators), the history
with filters, the rules and the notification channels (operators only, as in the API).

Operators (the API's write role for rules and channels) add rules, tune a rule's threshold
and on/off in place, delete rules they added (a shipped rule is turned off: the service
answers 409), and add, edit, turn on/off, test and delete channels. Every write goes through
the API's audited services; a refusal is a message on the input it names (400) or on the
row (409), never a 500; a viewer's hand-made POST is a 403. A webhook URL is never shown in
full (``services.channel_target_display``)."""

from __future__ import annotations

import math
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Case, IntegerField, QuerySet, Value, When
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods
from rest_framework.exceptions import APIException

from console.alerts import services
from console.alerts.choices import LEVEL_RANK, AlertLayer, AlertLevel, AlertState
from console.alerts.forms import AlertRuleForm, ChannelForm
from console.alerts.models import Alert, AlertRule, NotificationChannel
from console.alerts.services import alert_acknowledge, alert_rule_update
from console.core.choices import Role
from console.core.forms import call_service, save_through
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
        "channels": _shown(NotificationChannel.objects.order_by("name")) if can_operate else None,
        "shipped": services.SHIPPED_RULE_NAMES,
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
        {
            "rule": rule,
            "error": error,
            "saved": not error,
            "can_operate": True,
            "shipped": services.SHIPPED_RULE_NAMES,
        },
        status=200 if not error else 400,
    )


def _shown(channels: Any) -> list[NotificationChannel]:
    """The channels with ``shown_target``: the target as a page may show it."""
    out = list(channels)
    for channel in out:
        channel.shown_target = services.channel_target_display(channel.kind, channel.target)
    return out


def _operator_form(request: HttpRequest) -> None:
    """Viewers see no forms: the form page itself answers 403 as its POST does."""
    if not user_has_role(request.user, Role.OPERATOR):
        raise PermissionDenied(f"This needs the {Role.OPERATOR.value} role.")


def _htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true"


@page_view
@require_http_methods(["GET", "POST"])
def alert_rule_new(request: HttpRequest) -> HttpResponse:
    """The new-rule form; a POST creates it (``alert_rule_create``) and goes back to the
    rules, or shows the form again (400) with each refusal on its input."""
    if request.method == "POST":
        return _alert_rule_create(request)
    _operator_form(request)
    return render(request, "alerts/rule_form.html", {"form": AlertRuleForm()})


@action_view(Role.OPERATOR)
def _alert_rule_create(request: HttpRequest) -> HttpResponse:
    form = AlertRuleForm(request.POST)
    rule = None
    if form.is_valid():
        rule = call_service(
            form, services.alert_rule_create, actor=request.user, **form.service_fields()
        )
    if rule is None:
        return render(request, "alerts/rule_form.html", {"form": form}, status=400)
    messages.success(request, f"Rule {rule.name} created; it is evaluated from the next minute.")
    return HttpResponseRedirect(reverse("alerts-page") + f"#rule-{rule.pk}")


@action_view(Role.OPERATOR)
def alert_rule_delete_action(request: HttpRequest, pk: int) -> HttpResponse:
    """Delete a rule an operator added, with its alerts' history. htmx gets the rule's row
    back (emptied, or with the refusal: 409 for a shipped rule); a plain POST goes back to
    the rules with a message."""
    rule = get_object_or_404(AlertRule, pk=pk)
    name = rule.name
    try:
        services.alert_rule_delete(actor=request.user, rule=rule)
    except (APIException, ValidationError) as exc:
        context = {"rule": rule, "error": _error_text(exc), "can_operate": True}
        context["shipped"] = services.SHIPPED_RULE_NAMES
        return render(request, "alerts/_rule_row.html", context, status=409)
    if _htmx(request):
        return render(request, "alerts/_deleted_row.html", {"id": f"rule-{pk}", "name": name})
    messages.success(request, f"Rule {name} deleted.")
    return HttpResponseRedirect(reverse("alerts-page") + "#rules")


@page_view
@require_http_methods(["GET", "POST"])
def channel_new(request: HttpRequest) -> HttpResponse:
    """The new-channel form; a POST creates it (``channel_create``)."""
    if request.method == "POST":
        return _channel_save(request, None)
    _operator_form(request)
    return render(request, "alerts/channel_form.html", {"form": ChannelForm(), "channel": None})


@page_view
@require_http_methods(["GET", "POST"])
def channel_edit(request: HttpRequest, pk: int) -> HttpResponse:
    """The edit form of one channel (a webhook's URL is not shown; empty keeps it)."""
    if request.method == "POST":
        return _channel_save(request, pk)
    _operator_form(request)
    channel = get_object_or_404(NotificationChannel, pk=pk)
    context = {"form": ChannelForm(channel=channel), "channel": channel}
    return render(request, "alerts/channel_form.html", context)


@action_view(Role.OPERATOR)
def _channel_save(request: HttpRequest, pk: int | None) -> HttpResponse:
    """Create or change a channel through the services; back to the channels with a
    message, or the form again (400) with each refusal on its input."""
    channel = get_object_or_404(NotificationChannel, pk=pk) if pk is not None else None
    form = ChannelForm(request.POST, channel=channel)
    saved = save_through(
        form, actor=request.user, create=services.channel_create,
        update=services.channel_update, instance=channel, instance_kwarg="channel",
    )  # fmt: skip
    if saved is None:
        if channel is not None:
            channel.refresh_from_db()
        form.forget_webhook_url()
        context = {"form": form, "channel": channel}
        return render(request, "alerts/channel_form.html", context, status=400)
    verb = "created" if channel is None else "saved"
    messages.success(request, f"Channel {saved.name} {verb}.")
    return HttpResponseRedirect(reverse("alerts-page") + f"#channel-{saved.pk}")


def _channel_row(
    request: HttpRequest,
    channel: NotificationChannel,
    *,
    message: str = "",
    ok: bool = True,
    status: int = 200,
) -> HttpResponse:
    (shown,) = _shown([channel])
    context = {"c": shown, "message": message, "ok": ok}
    return render(request, "alerts/_channel_row.html", context, status=status)


@action_view(Role.OPERATOR)
def channel_enable_action(request: HttpRequest, pk: int) -> HttpResponse:
    """Turn a channel on (``enabled=on``) or off; answers the channel's row."""
    channel = get_object_or_404(NotificationChannel, pk=pk)
    enabled = request.POST.get("enabled") == "on"
    try:
        channel = services.channel_update(actor=request.user, channel=channel, enabled=enabled)
    except (APIException, ValidationError) as exc:
        channel.refresh_from_db()
        return _channel_row(request, channel, message=_error_text(exc), ok=False, status=409)
    return _channel_row(request, channel, message="turned on" if enabled else "turned off")


@action_view(Role.OPERATOR)
def channel_test_action(request: HttpRequest, pk: int) -> HttpResponse:
    """Send one test notification (``channel_test``, blocking up to the webhook timeout);
    answers the channel's row with what the delivery said."""
    channel = get_object_or_404(NotificationChannel, pk=pk)
    delivery = services.channel_test(actor=request.user, channel=channel)
    verdict = "test sent" if delivery["ok"] else "test failed"
    return _channel_row(
        request, channel, message=f"{verdict}: {delivery['detail']}", ok=delivery["ok"]
    )


@action_view(Role.OPERATOR)
def channel_delete_action(request: HttpRequest, pk: int) -> HttpResponse:
    """Remove a channel; htmx gets its row emptied, a plain POST goes back to the page."""
    channel = get_object_or_404(NotificationChannel, pk=pk)
    name = channel.name
    try:
        services.channel_delete(actor=request.user, channel=channel)
    except (APIException, ValidationError) as exc:
        return _channel_row(request, channel, message=_error_text(exc), ok=False, status=409)
    if _htmx(request):
        return render(request, "alerts/_deleted_row.html", {"id": f"channel-{pk}", "name": name})
    messages.success(request, f"Channel {name} deleted.")
    return HttpResponseRedirect(reverse("alerts-page") + "#channels")
