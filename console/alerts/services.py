"""Alert writes: rules and channels (API, admin and the alerts page), the periodic evaluation
(beat task ``orchestrator.alerts.evaluate``) and notification delivery.

A shipped rule (``defaults.DEFAULT_RULES``, by name) is tuned or turned off, never deleted:
``alert_rules_sync_defaults`` would install it again. A channel's webhook URL may carry a
token, so the audit log (readable by viewers) records it masked (``channel_target_display``:
scheme, host and a fingerprint), as the pages show it.

Evaluation (``alerts_evaluate``) runs in one transaction: for every enabled rule it aggregates
each subject's samples over the rule's window, opens an alert for a new breach, refreshes a
firing one (never a second row: deduplication) and resolves one whose condition stopped
holding. A subject with no samples in the window keeps its alert as it is (silence is not
recovery). Notifications are sent after the commit, outside the transaction: a webhook is a
blocking HTTP POST with a timeout, e-mail goes through Django's mail backend; each delivery,
good or failed, is recorded on the alert. A failed delivery never fails the evaluation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.core.validators import URLValidator, validate_email
from django.db import transaction
from django.db.models import Avg, Max, Min
from django.utils import timezone

from console.alerts.choices import (
    LEVEL_RANK,
    Aggregate,
    AlertLevel,
    AlertState,
    ChannelKind,
    Comparison,
)
from console.alerts.defaults import DEFAULT_RULES
from console.alerts.models import Alert, AlertRule, NotificationChannel
from console.core.api.exceptions import Conflict
from console.core.choices import AuditAction
from console.core.crud import Actor, audited_create, audited_delete, audited_update
from console.core.services import audit_record, model_snapshot
from console.telemetry.models import MetricSample

logger = logging.getLogger(__name__)

METRIC_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")  # Prometheus metric name
WEBHOOK_TIMEOUT_S = 5.0


# --- rules and channels ---------------------------------------------------------------------


def _rule_fields(fields: dict[str, Any]) -> dict[str, Any]:
    if "metric" in fields and not METRIC_RE.match(str(fields["metric"])):
        raise ValidationError(
            {"metric": ["Must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)."]}
        )
    return fields


@transaction.atomic
def alert_rule_create(*, actor: Actor, **fields: Any) -> AlertRule:
    """Add a rule (evaluated from the next beat tick)."""
    return audited_create(actor=actor, model=AlertRule, fields=_rule_fields(fields))


@transaction.atomic
def alert_rule_update(*, actor: Actor, rule: AlertRule, **fields: Any) -> AlertRule:
    """Change a rule; firing alerts are re-judged against it at the next evaluation."""
    rule, _ = audited_update(actor=actor, instance=rule, fields=_rule_fields(fields))
    return rule


SHIPPED_RULE_NAMES = frozenset(rule["name"] for rule in DEFAULT_RULES)


def rule_is_shipped(rule: AlertRule) -> bool:
    """Whether ``rule`` is one of the shipped defaults (by name)."""
    return rule.name in SHIPPED_RULE_NAMES


@transaction.atomic
def alert_rule_delete(*, actor: Actor, rule: AlertRule) -> None:
    """Delete a rule and its alerts' history. 409 for a shipped rule: the defaults sync
    would bring it back, so it is turned off (``enabled=False``) instead."""
    if rule_is_shipped(rule):
        raise Conflict(
            f"{rule.name} is a shipped rule: turn it off instead of deleting it "
            "(alert_rules_sync_defaults would install it again)."
        )
    audited_delete(actor=actor, instance=rule)


@transaction.atomic
def alert_rules_sync_defaults(*, actor: Actor = None) -> list[str]:
    """Create the shipped rules that do not exist yet (by name); existing rules, tuned or
    not, are left alone. Returns the names created."""
    created = []
    for rule in DEFAULT_RULES:
        if not AlertRule.objects.filter(name=rule["name"]).exists():
            audited_create(actor=actor, model=AlertRule, fields=dict(rule))
            created.append(rule["name"])
    return created


def _channel_fields(fields: dict[str, Any], current: NotificationChannel | None) -> dict[str, Any]:
    kind = fields.get("kind", current.kind if current else None)
    target = fields.get("target", current.target if current else None)
    if kind is None or target is None:
        return fields
    if kind == ChannelKind.WEBHOOK:
        try:
            URLValidator(schemes=["http", "https"])(target)
        except ValidationError:
            raise ValidationError({"target": ["Must be an http(s) URL for a webhook."]}) from None
    else:
        addresses = [a.strip() for a in str(target).split(",") if a.strip()]
        if not addresses:
            raise ValidationError({"target": ["Give at least one e-mail address."]})
        for address in addresses:
            try:
                validate_email(address)
            except ValidationError:
                raise ValidationError(
                    {"target": [f"Not an e-mail address: {address!r}."]}
                ) from None
        fields["target"] = ", ".join(addresses)
    return fields


def channel_target_display(kind: str, target: str) -> str:
    """What pages and the audit log show of a channel's target. E-mail addresses in full; a
    webhook URL as scheme and host plus a short fingerprint of the whole URL (its path or
    query may be a token; the fingerprint still tells two URLs apart)."""
    if kind != ChannelKind.WEBHOOK:
        return target
    fingerprint = hashlib.sha256(target.encode()).hexdigest()[:8]
    try:
        parts = urlsplit(target)
        host = parts.hostname or ""
        if parts.port:  # raises ValueError when out of range (the URL validator lets 99999 by)
            host = f"{host}:{parts.port}"
    except ValueError:
        return f"{target.split(':', 1)[0]}://… (sha256 {fingerprint})"
    hidden = "/…" if (parts.path not in ("", "/") or parts.query or parts.username) else "/"
    return f"{parts.scheme}://{host}{hidden} (sha256 {fingerprint})"


def _failure_text(exc: Exception, channel: NotificationChannel) -> str:
    """A failed delivery's reason, without the webhook URL or its path in it (an
    ``InvalidURL`` quotes them)."""
    text = str(exc)
    if channel.kind == ChannelKind.WEBHOOK:
        try:
            secret = urlsplit(channel.target)._replace(scheme="", netloc="").geturl()
        except ValueError:
            secret = ""
        for part in (channel.target, secret):
            if part and part != "/":
                text = text.replace(part, "…")
    return text[:300]


def _channel_snapshot(channel: NotificationChannel) -> dict[str, Any]:
    snapshot = model_snapshot(channel)
    snapshot["target"] = channel_target_display(channel.kind, channel.target)
    return snapshot


_STAMPS = ("created_at", "updated_at")


@transaction.atomic
def channel_create(*, actor: Actor, **fields: Any) -> NotificationChannel:
    """Add a webhook or e-mail channel (audited with the target masked)."""
    channel = NotificationChannel(**_channel_fields(fields, None))
    channel.full_clean()
    channel.save()
    audit_record(
        actor=actor, action=AuditAction.CREATE, instance=channel, after=_channel_snapshot(channel)
    )
    return channel


@transaction.atomic
def channel_update(
    *, actor: Actor, channel: NotificationChannel, **fields: Any
) -> NotificationChannel:
    """Change a channel (audited with the target masked; nothing is written when no value
    changes)."""
    fields = _channel_fields(fields, channel)
    unchanged, before = model_snapshot(channel, exclude=_STAMPS), _channel_snapshot(channel)
    for name, value in fields.items():
        setattr(channel, name, value)
    channel.full_clean()
    if model_snapshot(channel, exclude=_STAMPS) == unchanged:
        return channel
    channel.save()
    audit_record(
        actor=actor,
        action=AuditAction.UPDATE,
        instance=channel,
        before=before,
        after=_channel_snapshot(channel),
    )
    return channel


@transaction.atomic
def channel_delete(*, actor: Actor, channel: NotificationChannel) -> None:
    """Remove a channel (alerts keep the deliveries recorded under its name)."""
    pk = channel.pk
    audit_record(
        actor=actor, action=AuditAction.DELETE, instance=channel, before=_channel_snapshot(channel)
    )
    channel.delete()
    channel.pk = pk


def channel_test(*, actor: Actor, channel: NotificationChannel) -> dict[str, Any]:
    """Send one test notification to ``channel`` now, enabled or not (blocking: one webhook
    POST bounded by ``WEBHOOK_TIMEOUT_S``, or one e-mail). The delivery ``{channel, kind,
    event: "test", ok, detail, at}`` is returned and audited (verb ``test``); a failed
    delivery is an answer, not an error."""
    who = actor.get_username() if actor is not None and actor.is_authenticated else "system"
    document = {
        "event": "test",
        "alert": None,
        "message": f"Test notification from pdbridge to channel {channel.name}, sent by {who}.",
        "source": "pdbridge",
    }
    try:
        if channel.kind == ChannelKind.WEBHOOK:
            detail = _post_webhook(channel.target, document)
        else:
            detail = _send_email(
                channel.target.split(", "), f"[pdbridge] test: {channel.name}", document
            )
        ok = True
    except (urllib.error.URLError, OSError, ValueError) as exc:
        ok, detail = False, _failure_text(exc, channel)
        logger.warning(
            "alert_channel_test_failed", extra={"channel": channel.name, "error": detail}
        )
    delivery = {
        "channel": channel.name,
        "kind": channel.kind,
        "event": "test",
        "ok": ok,
        "detail": detail,
        "at": timezone.now().isoformat(),
    }
    with transaction.atomic():
        audit_record(
            actor=actor,
            action=AuditAction.ACTION,
            verb="test",
            instance=channel,
            after={"ok": ok, "detail": detail},
        )
    return delivery


# --- evaluation -----------------------------------------------------------------------------


def _aggregates(rule: AlertRule, since: datetime, until: datetime) -> dict[tuple[str, str], float]:
    """Each subject's aggregated value of the rule's metric over ``[since, until]``."""
    qs = MetricSample.objects.filter(name=rule.metric, at__gte=since, at__lte=until)
    if rule.subject_type:
        qs = qs.filter(subject_type=rule.subject_type)
    if rule.aggregate == Aggregate.LAST:
        out: dict[tuple[str, str], float] = {}
        for st, sid, value in qs.order_by("at", "id").values_list(
            "subject_type", "subject_id", "value"
        ):
            out[(st, sid)] = value  # later rows overwrite: the last one wins
        return out
    function = {Aggregate.AVG: Avg, Aggregate.MAX: Max, Aggregate.MIN: Min}[
        Aggregate(rule.aggregate)
    ]
    rows = qs.values("subject_type", "subject_id").annotate(v=function("value"))
    return {(r["subject_type"], r["subject_id"]): float(r["v"]) for r in rows}


def breaches(rule: AlertRule, value: float) -> bool:
    """Whether ``value`` breaches the rule's threshold."""
    if rule.comparison == Comparison.GT:
        return value > rule.threshold
    return value < rule.threshold


def _message(rule: AlertRule, subject: tuple[str, str], value: float) -> str:
    op = ">" if rule.comparison == Comparison.GT else "<"
    head = (
        f"{rule.name}: {rule.aggregate}({rule.metric}) over {rule.window_s}s = {value:.6g} "
        f"{op} {rule.threshold:g} for {subject[0]}:{subject[1]}"
    )
    return f"{head}. {rule.summary}"[:500]


def alerts_evaluate(*, now: datetime | None = None, notify: bool = True) -> dict[str, list[int]]:
    """Evaluate every enabled rule at ``now`` (beat: every minute; tests inject ``now``).
    Returns the ids of the alerts opened, still firing, and resolved."""
    now = now or timezone.now()
    events: list[tuple[str, int]] = []
    result: dict[str, list[int]] = {"fired": [], "firing": [], "resolved": []}
    with transaction.atomic():
        for rule in AlertRule.objects.filter(enabled=True).select_for_update():
            values = _aggregates(rule, now - timedelta(seconds=rule.window_s), now)
            open_alerts = {
                (a.subject_type, a.subject_id): a
                for a in Alert.objects.select_for_update().filter(
                    rule=rule, state=AlertState.FIRING
                )
            }
            for subject, value in sorted(values.items()):
                alert = open_alerts.get(subject)
                if breaches(rule, value):
                    if alert is None:
                        alert = Alert.objects.create(
                            rule=rule,
                            rule_name=rule.name,
                            level=rule.level,
                            layer=rule.layer,
                            subject_type=subject[0],
                            subject_id=subject[1],
                            value=value,
                            threshold=rule.threshold,
                            message=_message(rule, subject, value),
                            started_at=now,
                            last_seen_at=now,
                        )
                        result["fired"].append(alert.pk)
                        events.append(("firing", alert.pk))
                        logger.warning(
                            "alert_firing",
                            extra={"rule": rule.name, "subject": ":".join(subject), "value": value},
                        )
                    else:
                        alert.value, alert.last_seen_at = value, now
                        alert.message = _message(rule, subject, value)
                        alert.save(update_fields=["value", "last_seen_at", "message"])
                        result["firing"].append(alert.pk)
                elif alert is not None:
                    alert.state, alert.resolved_at, alert.last_seen_at = (
                        AlertState.RESOLVED,
                        now,
                        now,
                    )
                    alert.save(update_fields=["state", "resolved_at", "last_seen_at"])
                    result["resolved"].append(alert.pk)
                    events.append(("resolved", alert.pk))
                    logger.info(
                        "alert_resolved", extra={"rule": rule.name, "subject": ":".join(subject)}
                    )
    if notify:
        for event, pk in events:
            alert_notify(alert_id=pk, event=event)
    return result


@transaction.atomic
def alert_acknowledge(*, actor: Actor, alert: Alert, note: str = "") -> Alert:
    """Someone took a firing alert on: recorded (who, when, the note) and audited. The alert
    keeps firing until its condition stops holding (acknowledging is not resolving). 409 for
    a resolved or already acknowledged alert; 400 for a note over 300 characters."""
    locked = Alert.objects.select_for_update().get(pk=alert.pk)
    if locked.state != AlertState.FIRING:
        raise Conflict(f"Alert {locked.pk} is {locked.state}: only a firing alert is acknowledged.")
    if locked.acknowledged_at is not None:
        who = locked.acknowledged_by.get_username() if locked.acknowledged_by else "someone"
        raise Conflict(
            f"Alert {locked.pk} was acknowledged by {who} at {locked.acknowledged_at:%Y-%m-%d %H:%M:%S}."
        )
    note = str(note or "").strip()
    if len(note) > 300:
        raise ValidationError({"note": ["At most 300 characters."]})
    user = actor if actor is not None and actor.is_authenticated else None
    locked.acknowledged_at, locked.acknowledged_by, locked.acknowledged_note = (
        timezone.now(),
        user,
        note,
    )
    locked.save(update_fields=["acknowledged_at", "acknowledged_by", "acknowledged_note"])
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="acknowledge",
        instance=locked,
        after={"note": note},
    )
    return locked


# --- notification ---------------------------------------------------------------------------


def alert_document(alert: Alert, event: str) -> dict[str, Any]:
    """The JSON a webhook receives (also the e-mail body)."""
    return {
        "event": event,
        "alert": {
            "id": alert.pk,
            "rule": alert.rule_name,
            "level": alert.level,
            "layer": alert.layer,
            "subject": {"type": alert.subject_type, "id": alert.subject_id},
            "state": alert.state,
            "value": alert.value,
            "threshold": alert.threshold,
            "message": alert.message,
            "started_at": alert.started_at.isoformat(),
            "resolved_at": alert.resolved_at.isoformat() if alert.resolved_at else None,
        },
        "source": "pdbridge",
    }


def _post_webhook(url: str, document: dict[str, Any]) -> str:
    request = urllib.request.Request(  # noqa: S310 - the URL's scheme is validated on write
        url,
        data=json.dumps(document).encode(),
        headers={"Content-Type": "application/json", "User-Agent": "pdbridge-alerts"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as response:  # noqa: S310
        return f"HTTP {response.status}"


def _send_email(addresses: Iterable[str], subject: str, document: dict[str, Any]) -> str:
    sent = send_mail(
        subject=subject[:200],
        message=json.dumps(document, indent=2),
        from_email=settings.DEFAULT_FROM_EMAIL,
        recipient_list=list(addresses),
    )
    return f"{sent} message(s)"


def channels_for(alert: Alert, event: str) -> list[NotificationChannel]:
    """Enabled channels whose minimum level the alert reaches (and that want resolutions)."""
    rank = LEVEL_RANK[AlertLevel(alert.level)]
    return [
        c
        for c in NotificationChannel.objects.filter(enabled=True)
        if LEVEL_RANK[AlertLevel(c.min_level)] <= rank and (event == "firing" or c.send_resolved)
    ]


def alert_notify(*, alert_id: int, event: str) -> list[dict[str, Any]]:
    """Deliver one alert event to every matching channel; blocking (one webhook POST at a
    time, each bounded by ``WEBHOOK_TIMEOUT_S``). Deliveries are appended to the alert."""
    alert = Alert.objects.get(pk=alert_id)
    document = alert_document(alert, event)
    deliveries = []
    for channel in channels_for(alert, event):
        try:
            if channel.kind == ChannelKind.WEBHOOK:
                detail = _post_webhook(channel.target, document)
            else:
                subject = (
                    f"[pdbridge {alert.level}] {event}: {alert.rule_name} "
                    f"{alert.subject_type}:{alert.subject_id}"
                )
                detail = _send_email(channel.target.split(", "), subject, document)
            ok = True
        except (urllib.error.URLError, OSError, ValueError) as exc:
            ok, detail = False, _failure_text(exc, channel)
            logger.warning(
                "alert_notify_failed",
                extra={"alert": alert.pk, "channel": channel.name, "error": detail},
            )
        deliveries.append(
            {
                "channel": channel.name,
                "kind": channel.kind,
                "event": event,
                "ok": ok,
                "detail": detail,
                "at": timezone.now().isoformat(),
            }
        )
    if deliveries:
        with transaction.atomic():
            locked = Alert.objects.select_for_update().get(pk=alert_id)
            locked.notifications = [*locked.notifications, *deliveries]
            locked.save(update_fields=["notifications"])
    return deliveries
