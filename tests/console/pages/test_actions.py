"""Operator actions on pages: shown only to roles that may use them, refused (403) to the
rest even when posted by hand, and done through the services when allowed."""

from __future__ import annotations

import pytest

from console.core.models import AuditLog
from console.deployments.services import deployment_set_kill_switch, deployment_update
from console.runs.models import WorkflowRun
from console.runs.services import step_claim_next, step_fail

OPERATOR_MARKERS = ['id="kill-switch-button"', 'class="restore"', 'id="start-selfcheck"']


def _page_html(client, pages):
    w = pages.world
    return "".join(
        client.get(url).content.decode()
        for url in [f"/deployments/{w.deployment.pk}/", "/runs/", f"/runs/{pages.run.pk}/"]
    )


def _with_history(pages):
    deployment_update(actor=None, deployment=pages.world.deployment, remote_share_percent=10)


def test_viewer_sees_no_operator_buttons(client_as, pages):
    _with_history(pages)

    html = _page_html(client_as("viewer"), pages)

    for marker in [*OPERATOR_MARKERS, 'id="cancel-run"']:
        assert marker not in html
    assert "Admin" not in html.split("</header>")[0]


def test_operator_sees_the_buttons(client_as, pages):
    _with_history(pages)

    html = _page_html(client_as("operator"), pages)

    for marker in [*OPERATOR_MARKERS, 'id="cancel-run"', 'id="kill-dialog"']:
        assert marker in html


def _posts(pages):
    w = pages.world
    return [
        (f"/deployments/{w.deployment.pk}/kill-switch/", {"enabled": "on"}),
        (f"/deployments/{w.deployment.pk}/restore/", {"version": "1"}),
        ("/runs/start/", {"kind": "selfcheck"}),
        (f"/runs/{pages.run.pk}/cancel/", {}),
        (f"/runs/{pages.run.pk}/retry/", {"from_step": "0"}),
    ]


def test_viewer_posts_are_refused_and_change_nothing(client_as, pages):
    client = client_as("viewer")
    audit_before = AuditLog.objects.count()

    codes = [client.post(url, data).status_code for url, data in _posts(pages)]

    assert codes == [403] * 5
    pages.world.deployment.refresh_from_db()
    assert pages.world.deployment.kill_switch is False
    assert WorkflowRun.objects.count() == 1
    assert AuditLog.objects.count() == audit_before


def test_get_on_an_action_is_not_allowed(client_as, pages):
    url, _ = _posts(pages)[0]
    assert client_as("operator").get(url).status_code == 405


def test_operator_flips_the_kill_switch_and_it_is_audited(client_as, pages):
    client = client_as("operator")
    dep = pages.world.deployment

    on = client.post(f"/deployments/{dep.pk}/kill-switch/", {"enabled": "on"}, follow=True)
    dep.refresh_from_db()
    html = on.content.decode()

    assert dep.kill_switch is True
    assert "Kill switch ON" in html
    assert "ON: all local" in html
    entry = AuditLog.objects.filter(verb="kill_switch").first()
    assert entry is not None
    assert entry.after == {"kill_switch": True}

    client.post(f"/deployments/{dep.pk}/kill-switch/", {"enabled": "off"})
    dep.refresh_from_db()
    assert dep.kill_switch is False


def test_kill_switch_bad_value_names_the_field(client_as, pages):
    client = client_as("operator")
    response = client.post(
        f"/deployments/{pages.world.deployment.pk}/kill-switch/", {"enabled": "maybe"}, follow=True
    )
    assert "enabled: expected on or off" in response.content.decode()


def test_operator_restores_an_earlier_version(client_as, pages):
    dep = pages.world.deployment
    original = dep.remote_prefill_threshold_tokens
    deployment_update(actor=None, deployment=dep, remote_prefill_threshold_tokens=original + 1)
    dep.refresh_from_db()
    before = dep.version

    response = client_as("operator").post(
        f"/deployments/{dep.pk}/restore/", {"version": str(before - 1)}, follow=True
    )
    dep.refresh_from_db()

    assert dep.remote_prefill_threshold_tokens == original
    assert dep.version == before + 1
    assert f"Restored v{before - 1} as v{before + 1}" in response.content.decode()


def test_restore_says_the_kill_switch_stayed_on(client_as, pages):
    dep = pages.world.deployment
    old = dep.version
    deployment_set_kill_switch(actor=None, deployment=dep, enabled=True)

    response = client_as("operator").post(
        f"/deployments/{dep.pk}/restore/", {"version": str(old)}, follow=True
    )

    html = response.content.decode()
    dep.refresh_from_db()
    assert dep.kill_switch is True
    assert "The kill switch stayed ON (a restore never turns it off)" in html
    assert f"The deployment stays {dep.state}" in html


def test_restore_of_a_missing_version_is_a_message_not_a_500(client_as, pages):
    response = client_as("operator").post(
        f"/deployments/{pages.world.deployment.pk}/restore/", {"version": "999"}, follow=True
    )
    assert response.status_code == 200
    assert "has no version 999" in response.content.decode()


def test_operator_starts_a_selfcheck_run(client_as, pages):
    response = client_as("operator").post("/runs/start/", {"kind": "selfcheck"})

    run = WorkflowRun.objects.exclude(pk=pages.run.pk).get()
    assert response.status_code == 302
    assert response["Location"] == f"/runs/{run.pk}/"
    assert [s.name for s in run.steps.order_by("index")] == [
        "database",
        "worker",
        "scheduled_recheck",
    ]


@pytest.mark.parametrize("kind", ["", "deploy", "<script>"])
def test_start_refuses_unknown_kinds(client_as, pages, kind):
    response = client_as("operator").post("/runs/start/", {"kind": kind}, follow=True)
    assert "kind: expected one of selfcheck" in response.content.decode()
    assert WorkflowRun.objects.count() == 1


def test_cancel_then_retry_from_a_step(client_as, pages):
    client = client_as("operator")
    run = pages.run

    client.post(f"/runs/{run.pk}/cancel/")
    run.refresh_from_db()
    assert run.cancel_requested is True
    again = client.post(f"/runs/{run.pk}/cancel/", follow=True).content.decode()
    assert "already" in again or "cancel requested" in again

    claim = step_claim_next(run_id=run.pk, worker="w", stale_after_s=30)
    assert claim is None  # the cancel took effect at the next advance
    run.refresh_from_db()
    assert run.state == "canceled"
    client.post(f"/runs/{run.pk}/retry/", {"from_step": "1"})
    run.refresh_from_db()
    assert run.state == "running"
    assert run.cancel_requested is False
    assert [s.state for s in run.steps.order_by("index")][1:] == ["pending", "pending"]


def test_retry_button_on_a_failed_run(client_as, pages):
    run = pages.run
    run.cancel_requested = False
    run.save()
    claim = step_claim_next(run_id=run.pk, worker="w", stale_after_s=30)
    step_fail(step_id=claim.step_id, worker="w", error="database unreachable", evidence={})

    html = client_as("operator").get(f"/runs/{run.pk}/").content.decode()

    assert "database unreachable" in html
    assert html.count('class="retry"') == 3
    assert "hx-trigger" not in html  # a failed run is not live: no polling


def test_workflow_buttons_appear_for_operators_when_routed(client_as, pages):
    dep = pages.world.deployment

    operator = client_as("operator").get(f"/deployments/{dep.pk}/").content.decode()
    viewer = client_as("viewer").get(f"/deployments/{dep.pk}/").content.decode()

    for action in ("deploy", "canary"):  # routed by the deployments API
        assert f'hx-post="/api/deployments/{dep.pk}/{action}/"' in operator, action
    # Drills run from the drills page (``/api/drills/<id>/run/``), linked from here.
    assert f'href="/drills/?deployment={dep.pk}"' in operator
    assert 'class="workflow"' not in viewer
    assert "no successful drill in the last 7 days" in operator  # drills exist: computed, fails


def test_workflow_buttons_skip_actions_that_are_not_routed(settings):
    settings.ROOT_URLCONF = "tests.console.pages.urls_with_workflows"
    from console.deployments.views import _workflow_buttons

    assert [b["label"] for b in _workflow_buttons(7)] == ["Deploy", "Start canary", "Run drill"]
    settings.ROOT_URLCONF = "tests.console.pages.urls_only_deploy"

    assert [b["url"] for b in _workflow_buttons(7)] == ["/api/deployments/7/deploy/"]


def test_the_deployment_page_shows_a_proposal_an_operator_approves_with_a_toast(client_as, pages):
    """The Rebalancing table: measured capacities, splits, moves and the reason; Approve and
    Dismiss only for operators; Approve answers a toast linking the run it started, and the
    proposal then shows its run; a drained node carries its badge in the Pools table."""
    from console.deployments.services import pool_set_drained
    from console.schedules.models import RebalanceProposal

    w = pages.world
    node = w.decode_node
    proposal = RebalanceProposal.objects.create(
        deployment=w.deployment,
        reason="Measured producer 5 req/s vs consumer 50 req/s (ratio 0.10, prefill-bound)",
        measured={"producer_rps": 5.0, "consumer_rps": 50.0},
        current_split={"n_prefill": 0, "n_decode": 1},
        target_split={"n_prefill": 0, "n_decode": 1},
        moves=[],
    )
    page = f"/deployments/{w.deployment.pk}/"
    viewer = client_as("viewer").get(page).content.decode()
    assert 'id="rebalance"' in viewer
    assert "prefill-bound" in viewer
    assert f'id="approve-{proposal.pk}"' not in viewer

    operator = client_as("operator")
    assert f'id="approve-{proposal.pk}"' in operator.get(page).content.decode()
    toast = operator.post(f"/api/rebalance-proposals/{proposal.pk}/apply/", HTTP_HX_REQUEST="true")
    assert toast.status_code == 200
    proposal.refresh_from_db()
    assert proposal.state == "applying"
    body = toast.content.decode()
    assert f"Rebalancing proposal #{proposal.pk} is applying." in body
    assert f"/runs/{proposal.run_id}/" in body
    after = operator.get(page).content.decode()
    assert f'id="approve-{proposal.pk}"' not in after
    assert f'href="/runs/{proposal.run_id}/"' in after

    pool_set_drained(actor=None, pool=w.decode_pool, drain=[node])
    assert ">drained</span>" in operator.get(page).content.decode()
