"""Alerts API: role matrix, 400s naming the field, history filters."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from console.alerts.services import alerts_evaluate
from console.telemetry.services import sample_record

pytestmark = pytest.mark.django_db

RULE = {
    "name": "kv-queue",
    "layer": "service",
    "level": "warning",
    "metric": "kv_link_queue_bytes",
    "subject_type": "inventory.node",
    "aggregate": "max",
    "comparison": "gt",
    "threshold": 1e9,
    "window_s": 120,
}


@pytest.mark.parametrize(
    ("role", "rules", "alerts", "channels"),
    [
        (None, 401, 401, 401),
        ("viewer", 200, 200, 403),
        ("operator", 200, 200, 200),
        ("admin", 200, 200, 200),
    ],
)
def test_read_roles(api_as, role, rules, alerts, channels):
    api = api_as(role)
    assert api.get("/api/alert-rules/").status_code == rules
    assert api.get("/api/alerts/").status_code == alerts
    assert api.get("/api/alert-channels/").status_code == channels


@pytest.mark.parametrize(("role", "status"), [("viewer", 403), ("operator", 201), ("admin", 201)])
def test_write_roles(api_as, role, status):
    api = api_as(role)
    assert api.post("/api/alert-rules/", RULE, format="json").status_code == status
    channel = {"name": "hook", "kind": "webhook", "target": "https://hooks.example.com/x"}
    assert api.post("/api/alert-channels/", channel, format="json").status_code == status


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/alert-rules/", {**RULE, "metric": "kv queue"}, "metric"),
        ("/api/alert-rules/", {**RULE, "level": "panic"}, "level"),
        ("/api/alert-rules/", {**RULE, "window_s": 1}, "window_s"),
        ("/api/alert-rules/", {**RULE, "comparison": "ge"}, "comparison"),
        ("/api/alert-channels/", {"name": "h", "kind": "webhook", "target": "ftp://x"}, "target"),
        (
            "/api/alert-channels/",
            {"name": "m", "kind": "email", "target": "a@b.co, nope"},
            "target",
        ),
        ("/api/alert-channels/", {"name": "m", "kind": "sms", "target": "1"}, "kind"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(api_as, path, body, field):
    response = api_as("operator").post(path, body, format="json")
    assert response.status_code == 400
    assert field in response.json(), response.json()


def test_history_is_filterable_by_state(world, api_as):
    sample_record(
        subject=world.link,
        name="link_rtt_ms",
        value=1000.0,
        at=datetime(2026, 11, 30, tzinfo=UTC),
    )
    alerts_evaluate(now=datetime(2026, 11, 30, 0, 1, tzinfo=UTC))
    api = api_as("viewer")

    firing = api.get("/api/alerts/?state=firing").json()
    resolved = api.get("/api/alerts/?state=resolved").json()

    assert firing["count"] == 1
    assert firing["results"][0]["rule_name"] == "link-rtt-high"
    assert resolved["count"] == 0


def test_acknowledge_records_who_and_a_second_one_is_a_conflict(world, api_as):
    sample_record(
        subject=world.link, name="link_rtt_ms", value=1000.0, at=datetime(2026, 11, 30, tzinfo=UTC)
    )
    alerts_evaluate(now=datetime(2026, 11, 30, 0, 1, tzinfo=UTC), notify=False)
    alert_id = api_as("viewer").get("/api/alerts/?state=firing").json()["results"][0]["id"]
    url = f"/api/alerts/{alert_id}/acknowledge/"
    operator = api_as("operator")

    refused = api_as("viewer").post(url, {"note": "mine"})
    too_long = operator.post(url, {"note": "x" * 301})
    done = operator.post(url, {"note": "INC-7"})
    again = operator.post(url, {})

    assert refused.status_code == 403
    assert too_long.status_code == 400
    assert "note" in too_long.json()
    assert done.status_code == 200
    assert done.json()["acknowledged_note"] == "INC-7"
    assert done.json()["acknowledged_by"].startswith("operator")
    assert done.json()["state"] == "firing"
    assert again.status_code == 409
    assert "was acknowledged by operator" in again.json()["detail"]


def test_a_shipped_rule_is_not_deleted_an_added_one_is(api_as):
    from console.alerts.models import AlertRule

    operator = api_as("operator")
    added = operator.post("/api/alert-rules/", RULE, format="json").json()
    shipped = AlertRule.objects.get(name="link-rtt-high")

    refused = operator.delete(f"/api/alert-rules/{shipped.pk}/")
    deleted = operator.delete(f"/api/alert-rules/{added['id']}/")

    assert refused.status_code == 409
    assert refused.json()["detail"].startswith("link-rtt-high is a shipped rule")
    assert AlertRule.objects.filter(pk=shipped.pk).exists()
    assert deleted.status_code == 204


def test_channel_writes_are_audited_with_the_webhook_url_masked(api_as):
    from console.core.models import AuditLog

    operator = api_as("operator")
    hook = "https://hooks.example.com/services/T0/B0/tok3n"
    made = operator.post(
        "/api/alert-channels/", {"name": "hook", "kind": "webhook", "target": hook}, format="json"
    ).json()
    operator.patch(f"/api/alert-channels/{made['id']}/", {"target": hook + "2"}, format="json")
    operator.delete(f"/api/alert-channels/{made['id']}/")

    entries = AuditLog.objects.filter(object_type="alerts.notificationchannel").order_by("id")

    assert [e.action for e in entries] == ["create", "update", "delete"]
    assert all("tok3n" not in str(e.before) + str(e.after) for e in entries)
    update = entries[1]
    assert update.before["target"].startswith("https://hooks.example.com/… (sha256 ")
    assert update.before["target"] != update.after["target"]  # the fingerprint tells them apart


def test_channel_test_mails_an_email_channel_and_is_audited(mailoutbox, make_user):
    from console.alerts.services import channel_create, channel_test
    from console.core.models import AuditLog

    channel = channel_create(actor=None, name="oncall", kind="email", target="a@ops.example")

    delivery = channel_test(actor=make_user("operator"), channel=channel)

    assert (delivery["ok"], delivery["event"], delivery["detail"]) == (True, "test", "1 message(s)")
    (mail,) = mailoutbox
    assert mail.subject == "[pdbridge] test: oncall"
    assert mail.to == ["a@ops.example"]
    assert AuditLog.objects.get(verb="test").after == {"ok": True, "detail": "1 message(s)"}


@pytest.mark.parametrize(
    ("target", "shown"),
    [
        ("https://hooks.example.com/T0/tok3n?x=1", "https://hooks.example.com/… (sha256 "),
        ("https://user:pw@hooks.example.com:8443/", "https://hooks.example.com:8443/… (sha256 "),
        ("http://hooks.example.com", "http://hooks.example.com/ (sha256 "),
        ("https://hooks.example.com:99999/tok3n", "https://… (sha256 "),  # a port out of range
    ],
)
def test_a_webhook_target_is_shown_as_host_and_fingerprint(target, shown):
    from console.alerts.services import channel_target_display

    display = channel_target_display("webhook", target)

    assert display.startswith(shown)
    assert "tok3n" not in display
    assert "pw" not in display
    assert channel_target_display("email", "a@ops.example, b@ops.example") == (
        "a@ops.example, b@ops.example"
    )


def test_a_failed_delivery_does_not_quote_the_webhook_url(db):
    from console.alerts.models import NotificationChannel
    from console.alerts.services import _failure_text

    channel = NotificationChannel(
        name="h", kind="webhook", target="https://hooks.example.com/T0/tok3n"
    )

    text = _failure_text(ValueError("URL can't contain control characters. '/T0/tok3n'"), channel)

    assert text == "URL can't contain control characters. '…'"
