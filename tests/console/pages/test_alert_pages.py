"""The alerts page (firing with acknowledge, filtered history, rules editable by operators,
channels for operators) and the node and link lists, as a browser meets them: rendered pages
and the htmx form posts, against the same audited services as the API."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.utils import timezone

from console.alerts.models import Alert, AlertRule, NotificationChannel
from console.alerts.services import alert_rules_sync_defaults, alerts_evaluate, channel_create
from console.core.models import AuditLog
from console.telemetry import names
from console.telemetry.services import sample_record

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _default_rules(db):
    alert_rules_sync_defaults()  # a flushed test database has lost the migration's rules


@pytest.fixture
def firing(world) -> Alert:
    now = timezone.now()
    sample_record(subject=world.link, name=names.LINK_RTT_MS, value=250.0, at=now)
    alerts_evaluate(now=now, notify=False)
    return Alert.objects.get(rule_name="link-rtt-high")


def test_a_viewer_sees_firing_history_and_rules_but_no_buttons_or_channels(firing, client_as):
    channel_create(actor=None, name="ops-hook", kind="webhook", target="https://ops.example/h")

    html = client_as("viewer").get("/alerts/").content.decode()

    assert f'id="alert-{firing.pk}"' in html
    assert "link-rtt-high" in html
    assert "Acknowledge</button>" not in html
    assert 'id="rules"' in html
    assert "ops-hook" not in html  # channels are operator reads, as in the API
    assert 'hx-post="/alert-rules/' not in html


def test_an_operator_acknowledges_and_it_is_audited_and_shown(firing, client_as):
    operator = client_as("operator")
    page = operator.get("/alerts/").content.decode()
    assert "Acknowledge</button>" in page
    assert f'hx-post="/alerts/{firing.pk}/acknowledge"' in page  # the page's action, not the API
    assert f'hx-post="/alert-rules/{firing.rule_id}/edit"' in page

    answer = operator.post(
        f"/alerts/{firing.pk}/acknowledge", {"note": "INC-42, on it"}, HTTP_HX_REQUEST="true"
    )

    assert answer.status_code == 200
    row = answer.content.decode()
    assert row.startswith(f'<tr id="alert-{firing.pk}"')  # the row htmx swaps in place
    assert "acknowledged by operator" in row
    assert "INC-42, on it" in row
    firing.refresh_from_db()
    assert firing.acknowledged_note == "INC-42, on it"
    assert firing.state == "firing"  # acknowledging is not resolving
    entry = AuditLog.objects.get(verb="acknowledge")
    assert entry.after == {"note": "INC-42, on it"}

    again = operator.post(f"/alerts/{firing.pk}/acknowledge", {"note": ""})
    assert again.status_code == 409
    assert "was acknowledged by operator" in again.content.decode()


def test_a_resolved_alert_cannot_be_acknowledged_and_viewers_cannot_post(firing, world, client_as):
    assert client_as("viewer").post(f"/alerts/{firing.pk}/acknowledge").status_code == 403
    later = timezone.now() + timedelta(seconds=1)
    sample_record(subject=world.link, name=names.LINK_RTT_MS, value=5.0, at=later)
    firing.rule.window_s = 1
    firing.rule.save()
    alerts_evaluate(now=later + timedelta(milliseconds=500), notify=False)

    answer = client_as("operator").post(f"/alerts/{firing.pk}/acknowledge", {"note": "late"})

    assert answer.status_code == 409
    assert "only a firing alert" in answer.content.decode()
    long_note = client_as("operator").post(f"/alerts/{firing.pk}/acknowledge", {"note": "x" * 301})
    assert long_note.status_code == 409  # still resolved: the state is checked first


def test_history_filters_and_a_bad_filter_is_named_not_a_500(firing, client_as):
    viewer = client_as("viewer")

    warning = viewer.get("/alerts/?level=warning&layer=link").content.decode()
    critical = viewer.get("/alerts/?level=critical").content.decode()
    bad = viewer.get("/alerts/?level=loud&state=%00")

    assert warning.count("link-rtt-high") >= 2  # firing table and history
    assert 'id="history"' not in critical
    assert bad.status_code == 200
    assert "level: &#x27;loud&#x27; is not one of" in bad.content.decode()


def test_an_operator_edits_a_rule_threshold_and_a_bad_value_names_the_field(client_as, db):
    rule = AlertRule.objects.get(name="link-rtt-high")
    operator = client_as("operator")

    bad = operator.post(f"/alert-rules/{rule.pk}/edit", {"threshold": "nan", "enabled": "on"})
    good = operator.post(f"/alert-rules/{rule.pk}/edit", {"threshold": "150"})

    assert bad.status_code == 400
    assert "threshold: &#x27;nan&#x27; is not a finite number" in bad.content.decode()
    assert good.status_code == 200
    assert 'badge good">saved' in good.content.decode()
    rule.refresh_from_db()
    assert (rule.threshold, rule.enabled) == (150.0, False)
    assert AuditLog.objects.filter(object_type="alerts.alertrule", action="update").exists()
    assert (
        client_as("viewer").post(f"/alert-rules/{rule.pk}/edit", {"threshold": "1"}).status_code
        == 403
    )


def test_node_list_filters_by_site_and_status(world, client_as):
    viewer = client_as("viewer")

    remote = viewer.get("/nodes/?site=remote").content.decode()
    unknown = viewer.get("/nodes/?status=sleepy").content.decode()

    assert world.prefill_node.hostname in remote
    assert world.decode_node.hostname not in remote
    assert "status: &#x27;sleepy&#x27; is not one of" in unknown
    assert world.decode_node.hostname in unknown  # the bad filter is ignored, not applied


def test_link_list_shows_last_probe_and_stale(world, client_as, settings):
    sample_record(subject=world.link, name=names.LINK_MEASURED_MBIT_S, value=812.0)
    settings.LINK_PROBE_S = 60

    html = client_as("viewer").get("/links/").content.decode()

    assert "812 Mbit/s" in html
    assert 'badge warn">stale' in html  # measured_at never set


# --- rule and channel management -------------------------------------------------------------


@dataclass
class Receiver:
    """A webhook endpoint on loopback that records the JSON bodies posted to it."""

    url: str
    bodies: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
def webhook_receiver() -> Iterator[Receiver]:
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            bodies.append(json.loads(self.rfile.read(length)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Receiver(url=f"http://127.0.0.1:{server.server_port}/hook", bodies=bodies)
    server.shutdown()
    server.server_close()


NEW_RULE = {
    "name": "kv-queue-high",
    "layer": "service",
    "level": "warning",
    "metric": "kv_link_queue_bytes",
    "subject_type": "inventory.node",
    "aggregate": "max",
    "comparison": "gt",
    "threshold": "1e9",
    "window_s": "120",
    "summary": "KV transfers queue up.",
    "enabled": "on",
}
HOOK = "https://hooks.example.com/services/T000/B000/s3cr3t-token"


def test_an_operator_creates_a_rule_and_a_bad_field_is_named(client_as):
    operator = client_as("operator")
    assert 'id="rule-new"' in operator.get("/alerts/").content.decode()
    assert operator.get("/alert-rules/new/").status_code == 200

    bad = operator.post("/alert-rules/new/", {**NEW_RULE, "metric": "kv queue"})
    worse = operator.post("/alert-rules/new/", {**NEW_RULE, "window_s": "5", "threshold": "x"})
    good = operator.post("/alert-rules/new/", NEW_RULE)

    assert bad.status_code == 400
    html = bad.content.decode()
    assert 'data-field="metric">Must be a Prometheus metric name' in html
    assert 'value="kv-queue-high"' in html  # what was typed stays
    assert worse.status_code == 400
    assert 'data-field="threshold">Enter a number.' in worse.content.decode()
    rule = AlertRule.objects.get(name="kv-queue-high")
    assert good.status_code == 302
    assert good["Location"] == f"/alerts/#rule-{rule.pk}"
    assert (rule.metric, rule.threshold, rule.window_s, rule.enabled) == (
        "kv_link_queue_bytes",
        1e9,
        120,
        True,
    )
    entry = AuditLog.objects.get(object_type="alerts.alertrule", object_id=str(rule.pk))
    assert entry.action == "create"
    assert entry.after["metric"] == "kv_link_queue_bytes"
    page = operator.get("/alerts/").content.decode()
    assert f'id="rule-{rule.pk}"' in page
    assert f'hx-post="/alert-rules/{rule.pk}/delete"' in page


def test_what_the_rule_service_refuses_is_named_on_its_input(client_as):
    operator = client_as("operator")

    window = operator.post("/alert-rules/new/", {**NEW_RULE, "window_s": "5"})
    taken = operator.post("/alert-rules/new/", {**NEW_RULE, "name": "link-rtt-high"})

    assert window.status_code == 400
    assert (
        'data-field="window_s">Ensure this value is greater than or equal to 10.'
        in window.content.decode()
    )
    assert taken.status_code == 400
    assert 'data-field="name">Alert rule with this Name already exists.' in taken.content.decode()
    assert not AlertRule.objects.filter(name="kv-queue-high").exists()


def test_an_operator_deletes_an_added_rule_but_not_a_shipped_one(client_as):
    operator = client_as("operator")
    operator.post("/alert-rules/new/", NEW_RULE)
    added = AlertRule.objects.get(name="kv-queue-high")
    shipped = AlertRule.objects.get(name="link-rtt-high")
    page = operator.get("/alerts/").content.decode()
    assert f'hx-post="/alert-rules/{shipped.pk}/delete"' not in page

    deleted = operator.post(f"/alert-rules/{added.pk}/delete", HTTP_HX_REQUEST="true")
    refused = operator.post(f"/alert-rules/{shipped.pk}/delete", HTTP_HX_REQUEST="true")

    assert deleted.status_code == 200
    assert deleted.content.decode().startswith(f'<tr id="rule-{added.pk}" class="deleted">')
    assert not AlertRule.objects.filter(pk=added.pk).exists()
    assert AuditLog.objects.filter(
        object_type="alerts.alertrule", object_id=str(added.pk), action="delete"
    ).exists()
    assert refused.status_code == 409
    assert "link-rtt-high is a shipped rule: turn it off instead" in refused.content.decode()
    assert AlertRule.objects.filter(pk=shipped.pk).exists()


def test_a_viewer_gets_no_forms_and_403_on_every_hand_made_post(client_as):
    rule = AlertRule.objects.get(name="link-rtt-high")
    channel = channel_create(actor=None, name="ops-hook", kind="webhook", target=HOOK)
    audited = AuditLog.objects.count()
    viewer = client_as("viewer")
    page = viewer.get("/alerts/").content.decode()
    assert 'id="rule-new"' not in page
    assert "/delete" not in page

    answers = [
        viewer.get("/alert-rules/new/"),
        viewer.post("/alert-rules/new/", NEW_RULE),
        viewer.post(f"/alert-rules/{rule.pk}/delete"),
        viewer.get("/alert-channels/new/"),
        viewer.post("/alert-channels/new/", {"name": "x", "kind": "webhook", "target": HOOK}),
        viewer.get(f"/alert-channels/{channel.pk}/edit/"),
        viewer.post(f"/alert-channels/{channel.pk}/edit/", {"name": "y", "kind": "email"}),
        viewer.post(f"/alert-channels/{channel.pk}/enable", {"enabled": "off"}),
        viewer.post(f"/alert-channels/{channel.pk}/test"),
        viewer.post(f"/alert-channels/{channel.pk}/delete"),
    ]

    assert [a.status_code for a in answers] == [403] * len(answers)
    assert AuditLog.objects.count() == audited
    assert not AlertRule.objects.filter(name="kv-queue-high").exists()
    channel.refresh_from_db()
    assert (channel.name, channel.enabled) == ("ops-hook", True)


def test_an_operator_creates_a_channel_and_the_webhook_url_is_never_shown(client_as):
    operator = client_as("operator")
    body = {"name": "ops-hook", "kind": "webhook", "min_level": "critical", "enabled": "on"}

    bad = operator.post("/alert-channels/new/", {**body, "target": "ftp://hooks.example.com/t0k"})
    good = operator.post("/alert-channels/new/", {**body, "target": HOOK})

    assert bad.status_code == 400
    html = bad.content.decode()
    assert 'data-field="target">Must be an http(s) URL for a webhook.' in html
    assert "t0k" not in html  # a typed webhook URL is not shown back
    channel = NotificationChannel.objects.get(name="ops-hook")
    assert good.status_code == 302
    assert good["Location"] == f"/alerts/#channel-{channel.pk}"
    assert (channel.target, channel.min_level, channel.send_resolved) == (HOOK, "critical", False)
    page = operator.get("/alerts/").content.decode()
    assert f'id="channel-{channel.pk}"' in page
    assert "https://hooks.example.com/… (sha256 " in page
    assert "s3cr3t" not in page
    entry = AuditLog.objects.get(object_type="alerts.notificationchannel", action="create")
    assert entry.after["target"].startswith("https://hooks.example.com/… (sha256 ")
    assert "s3cr3t" not in client_as("viewer").get("/audit/").content.decode()


def test_an_operator_edits_turns_off_and_deletes_a_channel(client_as):
    channel = channel_create(actor=None, name="ops-hook", kind="webhook", target=HOOK)
    operator = client_as("operator")
    url = f"/alert-channels/{channel.pk}/"

    form = operator.get(f"{url}edit/").content.decode()
    kept = operator.post(
        f"{url}edit/",
        {"name": "ops-hook", "kind": "webhook", "target": "", "min_level": "info", "enabled": "on"},
    )
    to_email = operator.post(
        f"{url}edit/", {"name": "ops-mail", "kind": "email", "target": "", "min_level": "info"}
    )
    off = operator.post(f"{url}enable", {"enabled": "off"}, HTTP_HX_REQUEST="true")

    assert "s3cr3t" not in form
    assert "Leave empty to keep it" in form
    assert kept.status_code == 302
    channel.refresh_from_db()
    assert (channel.target, channel.min_level) == (HOOK, "info")
    assert to_email.status_code == 400
    assert 'data-field="target">Give at least one e-mail address.' in to_email.content.decode()
    assert off.status_code == 200
    assert 'badge neutral">off' in off.content.decode()
    channel.refresh_from_db()
    assert channel.enabled is False
    updates = AuditLog.objects.filter(object_type="alerts.notificationchannel", action="update")
    assert updates.count() == 2
    assert all("s3cr3t" not in str(e.before) + str(e.after) for e in updates)

    gone = operator.post(f"{url}delete", HTTP_HX_REQUEST="true")

    assert gone.status_code == 200
    assert 'class="deleted"' in gone.content.decode()
    assert not NotificationChannel.objects.filter(pk=channel.pk).exists()
    assert AuditLog.objects.filter(
        object_type="alerts.notificationchannel", action="delete"
    ).exists()


def test_send_test_posts_to_the_webhook_and_says_what_it_answered(client_as, webhook_receiver):
    channel = channel_create(
        actor=None, name="ops-hook", kind="webhook", target=webhook_receiver.url
    )
    closed = channel_create(
        actor=None, name="dead-hook", kind="webhook", target="http://127.0.0.1:9/hook"
    )
    operator = client_as("operator")

    sent = operator.post(f"/alert-channels/{channel.pk}/test", HTTP_HX_REQUEST="true")
    failed = operator.post(f"/alert-channels/{closed.pk}/test", HTTP_HX_REQUEST="true")

    assert sent.status_code == 200
    assert "test sent: HTTP 200" in sent.content.decode()
    (received,) = webhook_receiver.bodies
    assert received["event"] == "test"
    assert "sent by operator" in received["message"]
    assert failed.status_code == 200
    assert "test failed:" in failed.content.decode()
    assert AuditLog.objects.filter(verb="test").count() == 2
