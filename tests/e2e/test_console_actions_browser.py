"""Actions as an operator clicks them in a real browser: acknowledging a firing alert swaps
its row (who and the note); Pause on a live canary answers a toast linking the canary and the
button turns into Resume without a reload; Run drill answers a toast linking the report it
started, and running it again shows the refusal in words; Start canary on the deployment page
links the canary, whose Abort says the share is back at 0 %; a traced request is found by id
and its legs and logs shown. No JSON reaches the page.
Screenshots go to ``var/screenshots/``."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from console.alerts.services import alert_rules_sync_defaults, alerts_evaluate
from console.deployments import flows
from console.drills import services as drills
from console.drills.models import DrillReport
from console.telemetry import names
from console.telemetry.services import sample_record
from tests.e2e.test_console_browser import _login

pytestmark = pytest.mark.django_db(transaction=True)


def test_operator_acknowledges_pauses_and_runs_a_drill(
    browser: Any, live_server: Any, make_user: Any, world: Any, screenshots: Any
) -> None:
    make_user("operator", username="operator")
    base = live_server.url
    alert_rules_sync_defaults()  # a flushed test database has lost the migration's rules
    sample_record(subject=world.link, name=names.LINK_RTT_MS, value=250.0)
    alerts_evaluate(now=timezone.now(), notify=False)
    canary = flows.canary_start(actor=None, deployment=world.deployment)
    drill = drills.drill_create(
        actor=None, name="cut-east", deployment=world.deployment, kind="link_cut"
    )
    page = _login(browser, base, "operator")

    page.goto(f"{base}/alerts/")
    row = page.locator("#firing tbody tr").first
    row.locator("input[name=note]").fill("INC-9, on it")
    row.locator("button", has_text="Acknowledge").click()
    page.wait_for_selector("#firing td.ack:has-text('acknowledged by operator')")
    assert "INC-9, on it" in page.inner_text("#firing")
    page.screenshot(path=str(screenshots / "alerts.png"), full_page=True)

    page.goto(f"{base}/canaries/{canary.pk}/")
    page.click("#canary-actions button:has-text('Pause')")
    page.wait_for_selector("#workflow-result .toast.good")
    toast = page.inner_text("#workflow-result")
    assert f"Canary run #{canary.pk} is" in toast
    assert "{" not in toast
    assert page.locator("#workflow-result a", has_text="the canary").count() == 1
    # The buttons reload on the toast's event: Resume replaces Pause without a page load.
    page.wait_for_selector("#canary-actions button:has-text('Resume')")
    page.screenshot(path=str(screenshots / "canary-paused.png"), full_page=True)

    page.goto(f"{base}/drills/?deployment={world.deployment.pk}")
    page.click("button:has-text('Run drill')")
    page.wait_for_selector("#workflow-result .toast.good")
    report = DrillReport.objects.get(drill=drill)
    link = page.locator("#workflow-result a", has_text="the report")
    assert link.get_attribute("href") == f"/drills/reports/{report.pk}/"
    page.click("button:has-text('Run drill')")
    page.wait_for_selector("#workflow-result .toast.bad")
    assert "Refused (409)" in page.inner_text("#workflow-result")
    page.screenshot(path=str(screenshots / "drill-run.png"), full_page=True)
    page.context.close()


def test_operator_starts_and_aborts_a_canary_and_opens_a_traced_request(
    browser: Any, live_server: Any, make_user: Any, world: Any, screenshots: Any
) -> None:
    from datetime import timedelta

    from console.runs.models import WorkflowRun
    from console.telemetry.services import trace_record_batch

    make_user("operator", username="operator")
    base = live_server.url
    legs = [
        {"leg": "prefill", "start_ms": 1.0, "end_ms": 40.0, "instance": world.prefill_node.hostname,
         "site": world.remote.name},
        {"leg": "transfer", "start_ms": 30.0, "end_ms": 45.0},
        {"leg": "decode", "start_ms": 2.0, "end_ms": 60.0, "instance": world.decode_node.hostname,
         "site": world.local.name},
    ]  # fmt: skip
    started = timezone.now() - timedelta(seconds=5)
    doc = {"request_id": "req-e2e-1", "started_at": started, "path": "remote", "total_ms": 60.0,
           "outcome": "ok", "legs": legs}  # fmt: skip
    trace_record_batch(node=world.decode_node, traces=[doc])
    page = _login(browser, base, "operator")
    page.on("dialog", lambda dialog: dialog.accept())  # Abort's confirm

    page.goto(f"{base}/deployments/{world.deployment.pk}/")
    page.click("button:has-text('Start canary')")
    page.wait_for_selector("#workflow-result .toast.good")
    run = WorkflowRun.objects.get(kind="canary")
    assert f"Canary run #{run.pk} is" in page.inner_text("#workflow-result")
    page.click("#workflow-result a:has-text('the canary')")
    page.wait_for_url(f"{base}/canaries/{run.pk}/")
    page.click("#canary-actions button:has-text('Abort')")
    page.wait_for_selector("#workflow-result .toast.good:has-text('cancel requested')")
    assert "the remote share is already 0 %" in page.inner_text("#workflow-result")
    world.deployment.refresh_from_db()
    assert world.deployment.remote_share_percent == 0
    assert WorkflowRun.objects.get(pk=run.pk).cancel_requested
    page.screenshot(path=str(screenshots / "canary-aborted.png"), full_page=True)

    world.prefill_node.reported_children = [{"name": "prefill-engine-1", "kind": "prefill-engine"}]
    world.prefill_node.save()
    page.goto(f"{base}/traces/")
    page.fill("input[name=request_id]", "req-e2e-1")
    page.click("button:has-text('Find')")
    page.wait_for_selector("#timeline")  # one trace of that id: Find opens it
    assert [page.locator(".tl-row").nth(i).get_attribute("data-leg") for i in range(3)] == [
        "prefill", "transfer", "decode",
    ]  # fmt: skip
    logs = page.inner_text("#logs")
    assert world.prefill_node.hostname in logs
    assert "grep -F 'req-e2e-1'" in page.text_content("#logs")  # under "from a shell"
    page.screenshot(path=str(screenshots / "trace.png"), full_page=True)
    # An operator follows the prefill leg's log link: the log page, searching for the request.
    link = page.locator("#logs a.log-link", has_text="prefill-engine-1")
    assert link.get_attribute("href") == (
        f"/nodes/{world.prefill_node.pk}/logs/prefill-engine-1/?q=req-e2e-1"
    )
    link.click()
    page.wait_for_url(f"{base}/nodes/{world.prefill_node.pk}/logs/prefill-engine-1/?q=req-e2e-1")
    assert page.input_value("#log-search input[name=q]") == "req-e2e-1"
    # No agent behind this world's node and no controller identity here: said, not a 500.
    assert "PDBRIDGE_CONTROLLER_TLS_CA: required to call agents" in page.inner_text("#log-error")
    page.context.close()
