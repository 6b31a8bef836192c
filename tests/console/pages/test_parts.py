"""The parts pages are made of: evidence tables, the readiness checklist, the security page's
TLS states, the nav registry, the console's own /metrics, and the heartbeat history."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.template import Context, Template
from django.utils import timezone

from console.core.nav import NavItem, nav_items, nav_register
from console.core.templatetags.console import evidence, human_bytes, state_class
from console.deployments.readiness import readiness
from console.inventory.services import node_heartbeat
from console.runs.services import run_create
from console.telemetry import names
from console.telemetry.models import MetricSample
from console.telemetry.services import sample_record


def test_evidence_renders_dicts_and_per_prompt_rows_as_tables():
    html = evidence(
        {
            "prompts": [
                {"tokens": 128, "match": True, "first_divergent_token": None},
                {"tokens": 4096, "match": False, "first_divergent_token": 17},
            ],
            "probe": {"mbit_s": 912.5, "rtt_ms": 10.25},
        }
    )

    assert html.count("<table") == 3
    assert "<th>first_divergent_token</th>" in html
    assert html.count('class="row-bad"') == 1  # the mismatching prompt stands out
    assert "<td>17</td>" in html
    assert "912.5" in html


def test_evidence_escapes_everything():
    html = evidence({"<b>key</b>": "<script>alert(1)</script>", "rows": [{"x": "<img>"}]})
    assert "<script>" not in html
    assert "<img>" not in html
    assert "<b>key" not in html
    assert "&lt;script&gt;" in html


def test_sig_rounds_measured_figures_for_tables():
    from console.core.templatetags.console import sig

    assert sig(0.0008311893924401346) == "0.0008312"
    assert sig(0.999000001) == "0.999"
    assert sig(123456.7) == "123457"
    assert sig(2) == 2  # whole numbers and None pass through
    assert sig(None) is None


def test_template_helpers():
    assert state_class("succeeded") == "good"
    assert state_class("lost") == "bad"
    assert state_class("running") == "warn"
    assert state_class("whatever") == "neutral"
    assert human_bytes(3 * 2**20) == "3.0 MiB"
    assert human_bytes(None) == "-"


def test_readiness_is_unknown_where_no_node_has_reported(world):
    items = {i.key: i for i in readiness(world.deployment, list(world.deployment.pools.all()))}

    assert items["weights"].state == "unknown"
    assert items["weights"].detail == (
        "dec-1@local has not reported its weights yet; pre-1@remote has not reported its weights yet"
    )
    assert items["instances"].state == "fail"  # no heartbeat yet
    assert items["wan"].state == "fail"
    assert "not probed" in items["wan"].detail
    assert items["certificates"].state == "unknown"
    assert items["monitoring"].state == "fail"
    assert items["drill"].state == "fail"  # no drill report passed
    assert not any(i.state == "pass" for i in items.values())


def test_readiness_passes_from_real_state(world):
    now = timezone.now()
    engines = {"prefill": "prefill-engine", "decode": "decode-engine"}
    for node, role in [(world.decode_node, "decode"), (world.prefill_node, "prefill")]:
        node_heartbeat(
            node=node,
            agent_version="t",
            clock=now,
            capacity={},
            children=[
                {
                    "name": "e",
                    "kind": engines[role],
                    "state": "running",
                    "healthy": True,
                    "deployment_id": world.deployment.pk,
                }
            ],
            faults=[],
            config_versions={},
            tls={"mtls": True, "not_after": now + timedelta(days=90), "allowlist_size": 1},
            weights=[{"model": "tiny", "child": "e", "state": "ok", "sha256": "ab" * 32}],
        )
    world.link.measured_mbit_s, world.link.rtt_ms, world.link.measured_at = 950.0, 9.5, now
    world.link.save()
    sample_record(subject=world.deployment, name=names.SUCCESS, value=1.0)
    pools = list(world.deployment.pools.select_related("site").prefetch_related("nodes"))

    items = {i.key: i.state for i in readiness(world.deployment, pools)}

    assert items == {
        "weights": "pass",
        "instances": "pass",
        "wan": "pass",
        "certificates": "pass",
        "monitoring": "pass",
        "drill": "fail",  # no drill yet: the one item real state alone cannot pass
    }


def test_readiness_drill_passes_from_a_passed_report_only(world):
    from console.drills import services as drill_services

    drill = drill_services.drill_create(
        actor=None, name="cut", deployment=world.deployment, kind="link_cut"
    )
    report = drill_services.drill_run(actor=None, drill=drill)
    pools = list(world.deployment.pools.all())
    assert {i.key: i.state for i in readiness(world.deployment, pools)}["drill"] == "fail"

    report.state, report.finished_at = "failed", timezone.now()
    report.save()
    assert {i.key: i.state for i in readiness(world.deployment, pools)}["drill"] == "fail"

    report.state = "passed"
    report.save()
    assert {i.key: i.state for i in readiness(world.deployment, pools)}["drill"] == "pass"


def test_heartbeats_record_history_for_the_node_page(world, client_as):
    for _ in range(3):
        node_heartbeat(
            node=world.decode_node,
            agent_version="t",
            clock=timezone.now(),
            capacity={},
            children=[
                {"name": "e", "kind": "decode-engine", "healthy": True},
                {"name": "g", "kind": "gateway", "healthy": False},
            ],
            faults=[],
            config_versions={},
        )

    healthy = MetricSample.objects.filter(name=names.NODE_CHILDREN_HEALTHY).values_list(
        "value", flat=True
    )
    html = client_as("viewer").get(f"/nodes/{world.decode_node.pk}/").content.decode()

    assert list(healthy) == [1.0, 1.0, 1.0]
    assert "3 beats" in html
    assert html.count("plotly-graph-div") == 2


def test_link_page_marks_config_versions_and_flags_a_stale_measurement(world, client_as, settings):
    from console.deployments.services import deployment_update

    now = timezone.now()
    for minutes, mbit_s in ((30, 900.0), (10, 400.0)):
        sample_record(
            subject=world.link,
            name=names.LINK_MEASURED_MBIT_S,
            value=mbit_s,
            at=now - timedelta(minutes=minutes),
        )
    deployment_update(actor=None, deployment=world.deployment, reason="t", checksum=False)
    version = world.deployment.version
    settings.LINK_PROBE_S = 60  # stale after 3 minutes
    world.link.measured_mbit_s, world.link.measured_at = 900.0, now - timedelta(minutes=10)
    world.link.save()

    html = client_as("viewer").get(f"/links/{world.link.pk}/").content.decode()

    assert f"{world.deployment.name} v{version}" in html  # the marker's label
    assert "400</b><span>last probe Mbit/s" in html
    # The sites at both ends chart the same link with the same markers.
    for site in (world.link.from_site_id, world.link.to_site_id):
        page = client_as("viewer").get(f"/sites/{site}/").content.decode()
        assert f"{world.deployment.name} v{version}" in page
    assert 'badge warn">stale' in html
    settings.LINK_PROBE_S = 3600
    html = client_as("viewer").get(f"/links/{world.link.pk}/").content.decode()
    assert 'badge warn">stale' not in html


def test_security_page_flags_expiring_and_missing_tls(world, client_as):
    now = timezone.now()
    node_heartbeat(
        node=world.decode_node,
        agent_version="t",
        clock=now,
        capacity={},
        children=[],
        faults=[],
        config_versions={},
        tls={
            "mtls": True,
            "subject": "dec-1",
            "sans": ["dec-1", "127.0.0.1"],
            "not_after": now + timedelta(days=5, hours=1),
            "ca_fingerprint": "cd" * 32,
            "allowlist_size": 2,
        },
    )

    html = client_as("viewer").get("/security/").content.decode()

    expiry = (now + timedelta(days=5, hours=1)).strftime("%Y-%m-%d")
    assert f'{expiry} <span class="badge warn">expires in 5 days</span>' in html
    assert '<code>dec-1</code> <span class="muted">SAN dec-1, 127.0.0.1</span>' in html
    assert "2 identities" in html
    assert "no heartbeat received yet" in html  # the prefill node never beat


def test_nav_registry_shows_entries_by_role_and_skips_unroutable_ones(db):
    nav_register(NavItem("Nowhere", "no-such-url-name"))

    viewer = [i["label"] for i in nav_items("viewer")]

    assert viewer[:7] == ["Overview", "Sites", "Nodes", "Links", "Alerts", "Traces", "Models"]
    assert "Nowhere" not in viewer
    assert nav_items(None) == []


def test_metrics_count_requests_by_view_and_runs_by_state(client, client_as, world):
    run_create(actor=None, kind="selfcheck", steps=["database"], start=False)
    client_as("viewer").get("/deployments/")

    text = client.get("/metrics").content.decode()

    assert (
        'pdbridge_console_requests_total{method="GET",status="200",view="deployments-page"}' in text
    )
    assert 'pdbridge_console_request_seconds_bucket{le="0.005",view="deployments-page"}' in text
    assert 'pdbridge_console_runs{state="pending"} 1.0' in text
    assert 'pdbridge_console_nodes{status="unknown"} 2.0' in text


def test_base_layout_loads_local_assets_only(client_as, db):
    html = client_as("viewer").get("/").content.decode()
    assert "/static/console/console.css" in html
    assert "/static/console/vendor/htmx-2.0.11.min.js" in html
    assert "http://" not in html.split("<body")[0]
    assert "https://" not in html.split("<body")[0]
    assert Template("{% load console %}{{ x|state_class }}").render(Context({"x": "ok"})) == "good"


def test_overview_panels_registered_by_features_render_for_their_role(client_as, db, settings):
    from pathlib import Path

    from console.core.panels import (
        OverviewPanel,
        overview_panel_register,
        overview_panel_unregister,
    )

    engine = dict(settings.TEMPLATES[0])
    engine["DIRS"] = [*engine["DIRS"], Path(__file__).parent / "templates"]
    settings.TEMPLATES = [engine]
    overview_panel_register(
        OverviewPanel("things", "Things", "tests/panel.html", lambda request: {"count": 3})
    )
    overview_panel_register(
        OverviewPanel("secret", "Secret", "tests/panel.html", dict, role="admin")
    )
    try:
        viewer = client_as("viewer").get("/").content.decode()
    finally:
        overview_panel_unregister("things")
        overview_panel_unregister("secret")

    assert "<h2>Things</h2>" in viewer
    assert "3 things for viewer" in viewer
    assert "Secret" not in viewer


def test_overview_shows_firing_alerts_loudest_first(
    client_as, world, django_assert_max_num_queries
):
    from console.alerts.models import Alert, AlertRule
    from console.alerts.services import alert_rules_sync_defaults

    alert_rules_sync_defaults(actor=None)
    rules = list(AlertRule.objects.order_by("id")[:3])
    now = timezone.now()
    levels = [("warning", "firing"), ("critical", "firing"), ("info", "resolved")]
    for rule, (level, state) in zip(rules, levels, strict=True):
        Alert.objects.create(
            rule=rule,
            rule_name=f"{level}-rule",
            level=level,
            layer="link",
            subject_type="inventory.link",
            subject_id=str(world.link.pk),
            state=state,
            value=0.9,
            threshold=0.7,
            message=f"{level} message",
            started_at=now,
            last_seen_at=now,
        )
    client = client_as("viewer")

    with django_assert_max_num_queries(16):
        html = client.get("/").content.decode()

    panel = html.split('id="panel-alerts"')[1]
    assert panel.index("critical-rule") < panel.index("warning-rule")
    assert "info-rule" not in panel  # resolved
    assert f'href="/links/{world.link.pk}/"' in panel


def test_overview_alerts_panel_empty_state(client_as, db):
    html = client_as("viewer").get("/").content.decode()
    assert "No alert is firing" in html


@pytest.mark.parametrize("value", ["²", "9" * 20, "-1", "1e3"])
def test_odd_ids_in_page_queries_and_forms_are_never_a_500(world, client_as, value):
    """``"²".isdigit()`` is true and ``int("²")`` raises; twenty digits overflow a bigint."""
    operator = client_as("operator")
    dep = world.deployment.pk
    gets = [
        f"/tidal/?deployment={value}",
        f"/tidal/new/?deployment={value}",
        f"/rollouts/?deployment={value}",
        f"/rollouts/new/?deployment={value}",
        f"/drills/?deployment={value}",
        f"/drills/new/?deployment={value}",
        f"/canaries/?deployment={value}",
        f"/planner/?scenario={value}",
    ]
    posts = [
        (f"/deployments/{dep}/restore/", {"version": value}),
        ("/gateway-keys/create/", {"deployment": value, "name": "k"}),
    ]
    for url in gets:
        assert operator.get(url).status_code < 500, url
    for url, body in posts:
        assert operator.post(url, body).status_code < 500, url
