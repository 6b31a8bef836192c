"""The console in a real browser: log in, register a system through the API, start a
selfcheck run and watch its steps turn green (a real Celery worker executes it), flip the kill
switch through its confirm dialog, see charts drawn with data points, and check a viewer sees
no operator buttons. Screenshots of the main pages go to ``var/screenshots/``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from console.core.services_tokens import api_token_issue
from console.deployments.models import Deployment
from console.inventory.models import Link, Node
from console.inventory.services import node_heartbeat
from console.telemetry import names
from console.telemetry.services import sample_record

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "pw-for-tests-1"
HYBRID = {
    "dtype_bytes": 2,
    "state_dtype_bytes": 4,
    "layers": [
        {"kind": "full", "count": 4, "kv_heads": 2, "head_dim": 64},
        {"kind": "linear", "count": 12, "num_heads": 4, "key_head_dim": 32, "value_head_dim": 32},
    ],
}


def _login(browser: Any, base: str, username: str) -> Any:
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    page.goto(f"{base}/login/?next=/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")
    return page


def _api(page: Any, base: str, token: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = page.request.post(
        f"{base}/api/{path}", data=body, headers={"Authorization": f"Token {token}"}
    )
    assert response.status == 201, (path, response.status, response.text())
    return response.json()


def _register_system(page: Any, base: str, token: str) -> dict[str, Any]:
    """Two sites, a node each, the link, a hybrid model and a deployment with both pools."""
    local = _api(
        page, base, token, "sites/", {"name": "local", "role": "decode", "region": "eu-west"}
    )
    remote = _api(
        page, base, token, "sites/", {"name": "remote", "role": "prefill", "region": "eu-north"}
    )
    dec = _api(
        page,
        base,
        token,
        "nodes/",
        {"site": local["id"], "hostname": "dec-1", "agent_address": "127.0.0.1:7071"},
    )
    pre = _api(
        page,
        base,
        token,
        "nodes/",
        {
            "site": remote["id"],
            "hostname": "pre-1",
            "agent_address": "127.0.0.1:7072",
            "accelerator_type": "H200",
            "accelerator_count": 8,
        },
    )
    link = _api(
        page,
        base,
        token,
        "links/",
        {"from_site": remote["id"], "to_site": local["id"], "provisioned_mbit_s": 1000},
    )
    model = _api(
        page,
        base,
        token,
        "models/",
        {
            "name": "hybrid-tiny",
            "family": "qwen3-next",
            "architecture": HYBRID,
            "parameter_count": 1_000_000,
            "weights_sha256": "ab" * 32,
        },
    )
    dep = _api(page, base, token, "deployments/", {"name": "demo", "model": model["id"]})
    _api(
        page,
        base,
        token,
        "pools/",
        {"deployment": dep["id"], "role": "decode", "site": local["id"], "nodes": [dec["id"]]},
    )
    _api(
        page,
        base,
        token,
        "pools/",
        {"deployment": dep["id"], "role": "prefill", "site": remote["id"], "nodes": [pre["id"]]},
    )
    # Canary dial at 60 %, as the recorded traffic below assumes.
    response = page.request.patch(
        f"{base}/api/deployments/{dep['id']}/",
        data={"remote_share_percent": 60},
        headers={"Authorization": f"Token {token}"},
    )
    assert response.status == 200, response.text()
    return {"deployment": dep["id"], "model": model["id"], "link": link["id"], "node": dec["id"]}


def _record_traffic(ids: dict[str, Any]) -> None:
    """What the agents, the gateway and the kv-link would report: heartbeats and a few
    minutes of history."""
    deployment = Deployment.objects.get(pk=ids["deployment"])
    link = Link.objects.get(pk=ids["link"])
    now = timezone.now()
    expiry = now + timedelta(days=80)
    for node in Node.objects.all():
        engine = "decode-engine" if node.site.name == "local" else "prefill-engine"
        node_heartbeat(
            node=node,
            agent_version="0.1.0",
            clock=now,
            capacity={"accelerators": 8},
            children=[{"name": "engine", "kind": engine, "state": "running", "healthy": True}],
            faults=[],
            config_versions={},
            tls={"mtls": True, "not_after": expiry, "allowlist_size": 1},
        )
    for i in range(20):
        at = now - timedelta(seconds=15 * (20 - i))
        for path, base in [("remote", 0.25), ("local", 0.6), ("fallback", 0.9)]:
            sample_record(
                subject=deployment,
                name=names.TTFT_P50,
                value=base + 0.01 * i,
                labels={"path": path},
                at=at,
            )
            sample_record(
                subject=deployment,
                name=names.TTFT_P99,
                value=2 * base + 0.02 * i,
                labels={"path": path},
                at=at,
            )
            sample_record(
                subject=deployment,
                name=names.TPOT,
                value=base / 20 + 0.001 * (i % 3),
                labels={"path": path},
                at=at,
            )
            sample_record(
                subject=deployment,
                name=names.REQUESTS,
                value={"remote": 6, "local": 3, "fallback": 1}[path],
                labels={"path": path},
                at=at,
            )
        sample_record(subject=deployment, name=names.SUCCESS, value=0.995, at=at)
        sample_record(
            subject=deployment,
            name=names.EFFECTIVE_THRESHOLD,
            value=4096 if i < 10 else 3072,
            at=at,
        )
        sample_record(subject=link, name=names.LINK_UTILIZATION, value=0.35 + 0.02 * (i % 5), at=at)
        sample_record(subject=link, name=names.LINK_MEASURED_MBIT_S, value=940 + i, at=at)
        sample_record(subject=link, name=names.LINK_RTT_MS, value=10 + 0.1 * (i % 4), at=at)
    link.measured_mbit_s, link.rtt_ms, link.measured_at = 958.0, 10.2, now
    link.save()


def _chart_points(page: Any) -> int:
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=20_000)
    return page.locator(".js-plotly-plot .scatterlayer path.point").count()


def test_operator_runs_selfcheck_flips_kill_switch_and_sees_charts(
    browser, live_server, make_user, start_worker, screenshots
):
    base = live_server.url
    admin = make_user("admin", username="admin")
    make_user("operator", username="operator")
    _, token = api_token_issue(actor=None, user=admin)
    start_worker()

    page = _login(browser, base, "admin")
    ids = _register_system(page, base, token)
    _record_traffic(ids)
    page.goto(f"{base}/")
    assert page.locator(".site-card").count() == 2
    assert "remote 60 %" in page.inner_text("#deployments")
    page.screenshot(path=str(screenshots / "overview.png"), full_page=True)
    page.context.close()

    page = _login(browser, base, "operator")
    page.goto(f"{base}/runs/")
    page.click("#start-selfcheck")
    page.wait_for_url(f"{base}/runs/*/")
    # htmx polls the steps fragment; the worker executes database, worker, scheduled re-check.
    page.wait_for_function(
        "document.querySelectorAll('#run-steps .step[data-state=succeeded]').length === 3",
        timeout=60_000,
    )
    assert page.inner_text("#run-state") == "succeeded"
    assert "round_trip_ms" in page.inner_text("#step-0")
    page.screenshot(path=str(screenshots / "run.png"), full_page=True)

    page.goto(f"{base}/deployments/{ids['deployment']}/")
    assert _chart_points(page) > 0
    assert page.locator("#charts .js-plotly-plot").count() == 5
    page.click("#kill-switch-button")
    assert page.locator("#kill-dialog").is_visible()
    page.click("#kill-confirm")
    page.wait_for_selector("text=Kill switch ON")
    assert "ON: all local" in page.inner_text("#kill-switch-state")
    assert Deployment.objects.get(pk=ids["deployment"]).kill_switch is True
    page.screenshot(path=str(screenshots / "deployment.png"), full_page=True)

    for name, path in [
        ("model", f"/models/{ids['model']}/"),
        ("link", f"/links/{ids['link']}/"),
        ("node", f"/nodes/{ids['node']}/"),
        ("runs", "/runs/"),
        ("security", "/security/"),
        ("audit", "/audit/"),
        ("planner", "/planner/"),
    ]:
        page.goto(f"{base}{path}")
        if name in {"model", "link"}:
            assert _chart_points(page) > 0
        page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)
    page.context.close()


def test_viewer_sees_no_operator_buttons(browser, live_server, make_user, world, screenshots):
    make_user("viewer", username="viewer")
    base = live_server.url

    page = _login(browser, base, "viewer")
    page.goto(f"{base}/deployments/{world.deployment.pk}/")
    deployment_buttons = page.locator(
        "#operator-actions, #kill-switch-button, button.restore"
    ).count()
    page.goto(f"{base}/runs/")
    run_buttons = page.locator("#start-selfcheck").count()
    page.screenshot(path=str(screenshots / "viewer-runs.png"), full_page=True)

    assert deployment_buttons == 0
    assert run_buttons == 0
    assert page.locator("text=Admin").count() == 0
    page.context.close()
