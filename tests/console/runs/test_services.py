"""Run and step state rules, driven through the services with an injected clock."""

from datetime import timedelta

import pytest
from django.utils import timezone

from console.core.api.exceptions import Conflict
from console.runs import services
from console.runs.models import WorkflowRun

pytestmark = pytest.mark.django_db

T0 = timezone.now()


def _run(steps=("a", "b")):
    return services.run_create(actor=None, kind="flaky", steps=list(steps), start=False)


def test_claim_moves_run_to_running_and_first_step_to_running():
    run = _run()

    claim = services.step_claim_next(run_id=run.pk, worker="w1", stale_after_s=30, now=T0)

    run.refresh_from_db()
    assert (claim.index, claim.name, claim.attempt, claim.resumed) == (0, "a", 1, False)
    assert run.state == "running"
    assert run.steps.get(index=0).state == "running"


def test_a_step_held_by_a_live_worker_is_not_claimed_twice():
    run = _run()
    services.step_claim_next(run_id=run.pk, worker="w1", stale_after_s=30, now=T0)

    second = services.step_claim_next(
        run_id=run.pk, worker="w2", stale_after_s=30, now=T0 + timedelta(seconds=10)
    )

    assert second is None


def test_a_step_whose_worker_died_is_resumed_with_a_new_attempt():
    run = _run()
    services.step_claim_next(run_id=run.pk, worker="w1", stale_after_s=30, now=T0)

    claim = services.step_claim_next(
        run_id=run.pk, worker="w2", stale_after_s=30, now=T0 + timedelta(seconds=31)
    )

    assert (claim.name, claim.attempt, claim.resumed) == ("a", 2, True)
    # The dead worker's late report is dropped: the step is no longer its own.
    assert services.step_succeed(step_id=claim.step_id, worker="w1", evidence={}) is False


def test_success_of_every_step_ends_the_run_succeeded():
    run = _run()
    for name in ("a", "b"):
        claim = services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0)
        assert claim.name == name
        assert (
            services.step_succeed(step_id=claim.step_id, worker="w", evidence={"n": name}) is True
        )

    assert services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0) is None

    run.refresh_from_db()
    assert run.state == "succeeded"
    assert [s.evidence for s in run.steps.order_by("index")] == [{"n": "a"}, {"n": "b"}]


def test_waiting_step_is_not_due_until_its_wake_time():
    run = _run()
    claim = services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0)
    services.step_wait(step_id=claim.step_id, worker="w", seconds=60, evidence={"x": 1}, now=T0)

    early = services.step_claim_next(
        run_id=run.pk, worker="w", stale_after_s=30, now=T0 + timedelta(seconds=10)
    )
    due = services.step_claim_next(
        run_id=run.pk, worker="w", stale_after_s=30, now=T0 + timedelta(seconds=61)
    )

    assert isinstance(early, services.NotDue)
    assert early.seconds == pytest.approx(50)
    assert (due.name, due.attempt) == ("a", 1)


def test_failure_stops_the_run_and_retry_resumes_from_that_step():
    run = _run()
    first = services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0)
    services.step_succeed(step_id=first.step_id, worker="w", evidence={"kept": True})
    second = services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0)
    services.step_fail(step_id=second.step_id, worker="w", error="boom", evidence={})
    run.refresh_from_db()
    assert run.state == "failed"
    assert run.error == "step 1 b: boom"

    services.run_retry(actor=None, run=run)

    run.refresh_from_db()
    steps = list(run.steps.order_by("index"))
    assert run.state == "running"
    assert [(s.state, s.evidence) for s in steps] == [
        ("succeeded", {"kept": True}),
        ("pending", {}),
    ]
    assert "attempt 1 failed: boom" in steps[1].log_excerpt
    retried = services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0)
    assert (retried.name, retried.attempt) == ("b", 2)


def test_rollback_ends_the_run_rolled_back():
    run = _run()
    claim = services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0)

    services.step_fail(
        step_id=claim.step_id, worker="w", error="gate", evidence={"g": 1}, rolled_back=True
    )

    run.refresh_from_db()
    assert run.state == "rolled_back"


def test_cancel_ends_the_run_at_its_next_advance_and_cannot_repeat():
    run = _run()
    services.run_cancel(actor=None, run=run)

    assert services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0) is None

    run.refresh_from_db()
    assert run.state == "canceled"
    assert run.steps.get(index=0).state == "canceled"
    with pytest.raises(Conflict):
        services.run_cancel(actor=None, run=run)


def test_retry_of_a_running_run_is_a_conflict():
    run = _run()
    services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30, now=T0)

    with pytest.raises(Conflict):
        services.run_retry(actor=None, run=WorkflowRun.objects.get(pk=run.pk))


def test_stalled_runs_are_found_by_stale_heartbeat_overdue_wake_and_lost_advance():
    dead, waiting, lost, healthy = _run(), _run(), _run(), _run()
    services.step_claim_next(run_id=dead.pk, worker="w", stale_after_s=30, now=T0)
    claim = services.step_claim_next(run_id=waiting.pk, worker="w", stale_after_s=30, now=T0)
    services.step_wait(step_id=claim.step_id, worker="w", seconds=5, evidence={}, now=T0)
    claim = services.step_claim_next(run_id=lost.pk, worker="w", stale_after_s=30, now=T0)
    services.step_succeed(step_id=claim.step_id, worker="w", evidence={}, now=T0)
    services.step_claim_next(
        run_id=healthy.pk, worker="w", stale_after_s=30, now=T0 + timedelta(seconds=100)
    )

    stalled = services.runs_stalled(stale_after_s=30, now=T0 + timedelta(seconds=100))

    assert set(stalled) >= {dead.pk, waiting.pk, lost.pk}
    assert healthy.pk not in stalled
