"""The alerts page (firing with acknowledge, filtered history, rules editable by operators,
channels for operators) and the node and link lists, as a browser meets them: rendered pages
and the htmx form posts, against the same audited services as the API."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console.alerts.models import Alert, AlertRule
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
