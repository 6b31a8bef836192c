"""A step's execution key (what agent request ids derive from): the same for a step resumed
after its worker died and for a Wait re-check, new for an operator's retry -- on the real
run services and database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console.runs import services
from console.runs.models import StepRun
from orchestrator import agentops
from orchestrator.executor import execution_key
from orchestrator.steps import StepContext

pytestmark = pytest.mark.django_db

TARGET = agentops.Target("prefill", "remote", "pre-1", "10.0.0.2:7070", {"model": "m"})


def _claim(run_id: int, worker: str, now):
    claim = services.step_claim_next(run_id=run_id, worker=worker, stale_after_s=60, now=now)
    assert isinstance(claim, services.Claim)
    return claim, StepRun.objects.get(pk=claim.step_id)


def _rid(run_id: int, step: StepRun) -> str:
    ctx = StepContext(
        run_id=run_id,
        kind="deploy",
        target_type="",
        target_id="",
        params={},
        step_index=step.index,
        step_name=step.name,
        attempt=step.attempt,
        resumed=False,
        evidence={},
        previous={},
        execution=execution_key(step),
    )
    return agentops.request_id(ctx, TARGET, "dep1-prefill", {"port": 8000})


def test_resume_repeats_the_request_id_and_retry_renews_it():
    run = services.run_create(actor=None, kind="selfcheck", steps=["launch"], start=False)
    t0 = timezone.now()
    first, step = _claim(run.pk, "w1:1", t0)
    before = _rid(run.pk, step)

    # The worker died: its heartbeat goes stale and another worker resumes the step.
    resumed, step = _claim(run.pk, "w2:1", t0 + timedelta(seconds=120))
    after_resume = _rid(run.pk, step)

    assert (first.attempt, resumed.attempt, resumed.resumed) == (1, 2, True)
    assert after_resume == before
    assert before.startswith(f"run{run.pk}-launch-s{step.pk}.")

    services.step_fail(step_id=step.pk, worker="w2:1", error="boom", evidence={})
    services.run_retry(actor=None, run=run, from_index=0)
    retried, step = _claim(run.pk, "w3:1", t0 + timedelta(seconds=240))
    after_retry = _rid(run.pk, step)

    assert (retried.attempt, retried.resumed) == (3, False)
    assert after_retry != before
    assert after_retry.split("-pre-1-")[1] == before.split("-pre-1-")[1]  # same child, settings
