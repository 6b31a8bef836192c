"""The canary list and canary page: empty and with data, the share step chart, each gate's
measurements against its limit (rows as ``orchestrator.workflows.canary.evaluate_gates``
writes them), the rollback reason, operator-only pause / resume / abort, bounded queries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console.deployments import flows
from console.deployments.canary_page import share_series
from console.runs.models import StepRun, WorkflowRun
from orchestrator.workflows.canary import evaluate_gates
from tests.console.pages.test_render import MAX_QUERIES

GATES = {
    "ttft_p50_ratio": 1.5,
    "ttft_p99_ratio": 2.0,
    "success_rate_min": 0.99,
    "link_utilization_max": 0.7,
}


def _figures(success_rate: float) -> dict:
    return {
        "success_rate": success_rate,
        "ttft_p50_remote_s": 0.2,
        "ttft_p99_remote_s": 0.9,
        "ttft_p50_local_s": 0.25,
        "ttft_p99_local_s": 0.6,
        "link_utilization_max": 0.3,
        "remote_requests": 120,
    }


@pytest.fixture
def canary(world):
    return flows.canary_start(actor=None, deployment=world.deployment)


def _finish(run: WorkflowRun, *, roll_back_at: int | None) -> WorkflowRun:
    """Walk ``run``'s steps as the workflow leaves them: passed steps with their gates, and
    a rolled-back one with ``failed_gate`` (success rate under its limit)."""
    start = timezone.now() - timedelta(minutes=30)
    steps = list(run.steps.order_by("index"))
    for i, step in enumerate(steps):
        step.started_at = start + timedelta(minutes=5 * i)
        step.finished_at = step.started_at + timedelta(minutes=4)
        share = int(step.name.removeprefix("share_"))
        failing = i == roll_back_at
        fig = _figures(0.9 if failing else 0.999)
        gates = evaluate_gates(fig, GATES)
        step.evidence = {"share_percent": share, "figures": fig, "gates": gates, "held": ""}
        if failing:
            step.evidence["failed_gate"] = next(g for g in gates if not g["passed"])
            step.state, step.error = "failed", "gate success_rate failed: 0.9 against limit 0.99"
            step.save()
            run.state, run.finished_at, run.error = "rolled_back", step.finished_at, step.error
            run.save()
            StepRun.objects.filter(run=run, index__gt=i).update(state="pending")
            return run
        step.state = "succeeded"
        step.save()
    run.state, run.finished_at = "succeeded", steps[-1].finished_at
    run.save()
    return run


def test_canary_list_empty(client_as, db, django_assert_max_num_queries):
    client = client_as("viewer")
    with django_assert_max_num_queries(MAX_QUERIES):
        html = client.get("/canaries/").content.decode()

    assert "No canary has run" in html


def test_canary_list_links_each_canary_in_bounded_queries(
    client_as, world, canary, django_assert_max_num_queries
):
    _finish(canary, roll_back_at=1)
    for _ in range(60):  # more canaries than a page
        WorkflowRun.objects.create(
            kind="canary", target_type="deployments.deployment", target_id=str(world.deployment.pk)
        )
    client = client_as("viewer")
    with django_assert_max_num_queries(MAX_QUERIES):
        response = client.get(f"/canaries/?deployment={world.deployment.pk}&page=2")

    assert response.status_code == 200
    assert f'href="/canaries/{canary.pk}/"' in response.content.decode()


def test_rolled_back_canary_shows_reason_share_chart_and_gates(
    client_as, canary, django_assert_max_num_queries
):
    run = _finish(canary, roll_back_at=1)
    client = client_as("viewer")
    with django_assert_max_num_queries(MAX_QUERIES):
        html = client.get(f"/canaries/{run.pk}/").content.decode()

    assert 'id="rollback-reason"' in html
    assert "gate <b>success_rate</b> measured 0.9 against limit 0.99" in html
    assert html.count("plotly-graph-div") >= 5  # share + four gates
    assert '"shape":"hv"' in html  # the share is a step chart
    assert "ttft_p99_ratio" in html
    assert "Pause" not in html  # a finished canary has no buttons


def test_share_series_steps_up_then_drops_to_zero_on_rollback(canary):
    run = _finish(canary, roll_back_at=1)
    steps = list(run.steps.order_by("index"))

    shares = [value for _, value in share_series(run, steps)]

    first, second = (int(s.name.removeprefix("share_")) for s in steps[:2])
    assert shares == [first, second, 0.0]


def test_successful_canary_holds_its_last_share(canary):
    run = _finish(canary, roll_back_at=None)

    points = share_series(run, list(run.steps.order_by("index")))

    assert points[-1] == (run.finished_at, 100.0)


def test_live_canary_buttons_for_operators_only(client_as, world, canary):
    viewer = client_as("viewer").get(f"/canaries/{canary.pk}/").content.decode()
    operator = client_as("operator").get(f"/canaries/{canary.pk}/").content.decode()

    assert "canary/pause" not in viewer
    assert f'hx-post="/api/deployments/{world.deployment.pk}/canary/pause/"' in operator
    assert f'hx-post="/api/deployments/{world.deployment.pk}/canary/abort/"' in operator
    assert "No gate judged yet" in operator
    assert "No data yet" in operator  # no step started: the share chart is empty


def test_paused_canary_offers_resume(client_as, world, canary):
    flows.canary_pause(actor=None, deployment=world.deployment)

    html = client_as("operator").get(f"/canaries/{canary.pk}/").content.decode()

    assert "canary/resume" in html
    assert "paused" in html


def test_pause_answers_a_toast_and_the_buttons_follow_the_run(client_as, world, canary):
    operator = client_as("operator")
    base = f"/api/deployments/{world.deployment.pk}/canary"

    paused = operator.post(f"{base}/pause/", HTTP_HX_REQUEST="true")
    buttons = operator.get(f"/canaries/{canary.pk}/actions/").content.decode()
    json_answer = operator.post(f"{base}/resume/")  # automation: JSON as always

    assert paused.status_code == 200
    toast = paused.content.decode()
    assert f"Canary run #{canary.pk} is" in toast
    assert "(paused)" in toast
    assert f'href="/canaries/{canary.pk}/"' in toast
    assert paused["HX-Trigger"] == "pdbridge-run-changed"
    assert 'hx-trigger="pdbridge-run-changed from:body, every 5s"' in buttons
    assert "canary/resume" in buttons
    assert "canary/pause" not in buttons
    assert json_answer.json()["id"] == canary.pk
    assert "canary/pause" in operator.get(f"/canaries/{canary.pk}/actions/").content.decode()
    assert client_as("viewer").get(f"/canaries/{canary.pk}/actions/").content == b""


def test_canary_pages_need_a_role_and_a_canary(client, client_as, canary):
    assert client.get(f"/canaries/{canary.pk}/").status_code == 302
    assert client_as(None).get("/canaries/").status_code == 403
    selfcheck = WorkflowRun.objects.create(kind="selfcheck")
    assert client_as("viewer").get(f"/canaries/{selfcheck.pk}/").status_code == 404


def test_deployment_and_run_pages_link_the_canary(client_as, world, canary):
    client = client_as("viewer")

    deployment = client.get(f"/deployments/{world.deployment.pk}/").content.decode()
    run = client.get(f"/runs/{canary.pk}/").content.decode()

    assert f'href="/canaries/?deployment={world.deployment.pk}"' in deployment
    assert f'href="/canaries/{canary.pk}/"' in run
    assert 'href="/canaries/"' in run  # nav


def test_deployment_page_says_a_canary_drives_the_share_and_why_it_paused(client_as, world, canary):
    page = f"/deployments/{world.deployment.pk}/"
    running = client_as("viewer").get(page).content.decode()
    flows.canary_pause(
        actor=None,
        deployment=world.deployment,
        reason="remote share changed under the canary (50 % -> 10 %) in config v9 by alice",
    )

    paused = client_as("viewer").get(page).content.decode()
    canary_page = client_as("operator").get(f"/canaries/{canary.pk}/").content.decode()

    assert 'id="canary-banner"' in running
    assert f'href="/canaries/{canary.pk}/">#{canary.pk}</a> is in progress' in running
    assert "the canary pauses at its next re-check and leaves your value" in running
    assert "canary-pause-reason" not in running
    assert "<b>paused</b>" in paused
    assert "Paused: remote share changed under the canary (50 % -&gt; 10 %)" in paused
    assert "Paused: remote share changed under the canary (50 % -&gt; 10 %)" in canary_page


def test_deployment_page_without_a_canary_has_no_banner(client_as, world):
    html = client_as("viewer").get(f"/deployments/{world.deployment.pk}/").content.decode()

    assert "canary-banner" not in html


def test_a_restore_on_the_page_that_moves_the_share_warns_of_the_canary(client_as, world):
    from console.deployments.flows import deployment_set_remote_share

    v_zero = world.deployment.version
    deployment_set_remote_share(actor=None, deployment=world.deployment, percent=40, reason="t")
    run = flows.canary_start(actor=None, deployment=world.deployment)

    response = client_as("operator").post(
        f"/deployments/{world.deployment.pk}/restore/", {"version": v_zero}, follow=True
    )

    shown = [(m.level_tag, str(m)) for m in response.context["messages"]]
    assert shown[0][0] == "success"
    assert shown[1][0] == "warning"
    assert f"Canary run #{run.pk} of {world.deployment.name} is in progress" in shown[1][1]
    assert "leaves your 0 % as set" in shown[1][1]
