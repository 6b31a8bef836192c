"""Alert evaluation over real telemetry samples (clock injected), deduplication, history, and
notification to a real local HTTP server (webhook) and Django's locmem mail backend."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from django.core import mail

from console.alerts.models import Alert, AlertRule
from console.alerts.services import alert_rule_update, alerts_evaluate, channel_create
from console.telemetry.services import sample_record

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class Receiver:
    """A real HTTP server on an ephemeral loopback port that records JSON POSTs."""

    def __init__(self, status: int = 200) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def rtt(link: Any, seconds: float, at: datetime) -> None:
    sample_record(subject=link, name="link_rtt_ms", value=seconds * 1000.0, at=at)


def test_default_rules_are_installed_for_every_layer_and_level():
    rules = AlertRule.objects.all()
    assert {r.layer for r in rules} == {"resource", "link", "service", "business"}
    assert {r.level for r in rules} == {"info", "warning", "critical"}


def test_breach_fires_once_stays_firing_then_resolves_with_history(world, receiver):
    channel_create(
        actor=None, name="ops-hook", kind="webhook", target=receiver.url, min_level="info"
    )
    channel_create(
        actor=None, name="ops-mail", kind="email", target="oncall@example.com, sre@example.com"
    )
    for i in range(5):  # mean 150 ms over the 300 s window > 100 ms
        rtt(world.link, 0.15, NOW - timedelta(seconds=60 * i))

    first = alerts_evaluate(now=NOW)
    second = alerts_evaluate(now=NOW + timedelta(seconds=30))

    alert = Alert.objects.get(rule_name="link-rtt-high")
    assert first["fired"] == [alert.pk]
    assert second == {"fired": [], "firing": [alert.pk], "resolved": []}
    assert Alert.objects.filter(rule_name="link-rtt-high").count() == 1  # deduplicated
    assert alert.subject_type == "inventory.link"
    assert alert.subject_id == str(world.link.pk)
    assert alert.value == pytest.approx(150.0)
    assert alert.level == "warning"
    # webhook: one POST, with the alert document
    assert len(receiver.received) == 1
    doc = receiver.received[0]
    assert doc["event"] == "firing"
    assert doc["alert"]["rule"] == "link-rtt-high"
    assert doc["alert"]["subject"] == {"type": "inventory.link", "id": str(world.link.pk)}
    # e-mail: one message to both addresses
    assert len(mail.outbox) == 1
    assert mail.outbox[0].to == ["oncall@example.com", "sre@example.com"]
    assert "[pdbridge warning] firing: link-rtt-high" in mail.outbox[0].subject
    assert [(d["channel"], d["ok"]) for d in alert.notifications] == [
        ("ops-hook", True),
        ("ops-mail", True),
    ]

    # The link recovers: the window's mean falls under the threshold.
    for i in range(10):
        rtt(world.link, 0.01, NOW + timedelta(seconds=301 + 10 * i))
    later = NOW + timedelta(seconds=400)
    result = alerts_evaluate(now=later)

    alert.refresh_from_db()
    assert result["resolved"] == [alert.pk]
    assert alert.state == "resolved"
    assert alert.resolved_at == later
    assert [d["event"] for d in receiver.received] == ["firing", "resolved"]
    assert len(mail.outbox) == 2

    # A new breach after resolution is a new alert; the old one stays as history.
    rtt(world.link, 5.0, later + timedelta(seconds=10))
    alerts_evaluate(now=later + timedelta(seconds=20))
    assert list(
        Alert.objects.filter(rule_name="link-rtt-high").values_list("state", flat=True)
    ) == [
        "firing",
        "resolved",
    ]


def test_no_samples_in_the_window_leaves_a_firing_alert_alone(world):
    rtt(world.link, 1.0, NOW)
    alerts_evaluate(now=NOW)

    result = alerts_evaluate(now=NOW + timedelta(hours=1))

    assert result == {"fired": [], "firing": [], "resolved": []}
    assert Alert.objects.get(rule_name="link-rtt-high").state == "firing"


def test_lower_than_rules_min_level_and_disabled_rules(world, receiver):
    channel_create(
        actor=None, name="critical-only", kind="webhook", target=receiver.url, min_level="critical"
    )
    sample_record(subject=world.deployment, name="gateway_success_ratio", value=0.9, at=NOW)
    sample_record(subject=world.deployment, name="gateway_ttft_p99_seconds", value=6.0, at=NOW)

    alerts_evaluate(now=NOW)

    assert set(Alert.objects.values_list("rule_name", "level")) == {
        ("success-rate-low", "critical"),
        ("ttft-p99-high", "warning"),
    }
    assert [d["alert"]["rule"] for d in receiver.received] == ["success-rate-low"]

    alert_rule_update(actor=None, rule=AlertRule.objects.get(name="queue-long"), enabled=False)
    sample_record(subject=world.decode_node, name="engine_queue_length", value=1000, at=NOW)
    alerts_evaluate(now=NOW + timedelta(seconds=1))
    assert not Alert.objects.filter(rule_name="queue-long").exists()


def test_last_aggregate_uses_the_most_recent_sample(world):
    sample_record(
        subject=world.link, name="link_measured_ratio", value=0.9, at=NOW - timedelta(seconds=60)
    )
    sample_record(
        subject=world.link, name="link_measured_ratio", value=0.3, at=NOW - timedelta(seconds=1)
    )

    alerts_evaluate(now=NOW)

    alert = Alert.objects.get(rule_name="link-rate-low")
    assert alert.value == 0.3
    assert alert.level == "critical"


def test_a_failing_webhook_is_recorded_and_does_not_stop_evaluation(world):
    dead = Receiver()
    url = dead.url
    dead.close()  # nothing listens there any more: connection refused
    channel_create(actor=None, name="dead-hook", kind="webhook", target=url, min_level="info")
    rtt(world.link, 1.0, NOW)

    alerts_evaluate(now=NOW)

    alert = Alert.objects.get(rule_name="link-rtt-high")
    assert alert.notifications[0]["channel"] == "dead-hook"
    assert alert.notifications[0]["ok"] is False
    assert alert.notifications[0]["detail"]
    assert alert.state == "firing"


def test_webhook_non_2xx_is_a_failed_delivery(world):
    refusing = Receiver(status=500)
    try:
        channel_create(
            actor=None, name="five-hundred", kind="webhook", target=refusing.url, min_level="info"
        )
        rtt(world.link, 1.0, NOW)
        alerts_evaluate(now=NOW)
    finally:
        refusing.close()

    delivery = Alert.objects.get(rule_name="link-rtt-high").notifications[0]
    assert delivery["ok"] is False
    assert "500" in delivery["detail"]


def test_channels_that_skip_resolutions_hear_only_the_firing(world, receiver):
    channel_create(
        actor=None,
        name="fire-only",
        kind="webhook",
        target=receiver.url,
        min_level="warning",
        send_resolved=False,
    )
    rtt(world.link, 1.0, NOW)
    alerts_evaluate(now=NOW)
    rtt(world.link, 0.001, NOW + timedelta(seconds=1))
    for i in range(100):  # enough good samples to pull the 5-minute mean under 100 ms
        rtt(world.link, 0.001, NOW + timedelta(seconds=2 + i))

    result = alerts_evaluate(now=NOW + timedelta(seconds=200))

    assert len(result["resolved"]) == 1
    assert [d["event"] for d in receiver.received] == ["firing"]
