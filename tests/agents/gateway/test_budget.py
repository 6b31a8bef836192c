import asyncio

import pytest

from agents.gateway.budget import FallbackBudget, TokenBucket
from agents.gateway.tuning import ThresholdTuner, TuningSettings, site_pressure
from tests.agents.gateway.clock import Clock


def test_bucket_starts_full_and_refills_at_rate():
    clock = Clock(0.0)
    bucket = TokenBucket(rate=10, burst=3, clock=clock)

    assert [bucket.try_take() for _ in range(4)] == [True, True, True, False]
    assert bucket.seconds_until_token() == pytest.approx(0.1)
    clock.now += 0.1
    assert bucket.try_take()
    assert not bucket.try_take()


def test_bucket_never_exceeds_burst():
    clock = Clock(0.0)
    bucket = TokenBucket(rate=10, burst=2, clock=clock)
    clock.now += 100

    assert bucket.tokens == 2


def test_bucket_refuses_nonsense():
    with pytest.raises(ValueError, match="rate > 0"):
        TokenBucket(rate=0, burst=1, clock=Clock(0.0))


def test_budget_waits_for_a_token_within_bound():
    async def scenario():
        budget = FallbackBudget(
            rate=50, burst=1, max_wait_s=1.0, max_waiters=4, clock=asyncio.get_running_loop().time
        )
        assert await budget.acquire()
        return await budget.acquire()

    assert asyncio.run(scenario()) is True


def test_budget_refuses_when_wait_would_exceed_bound():
    async def scenario():
        budget = FallbackBudget(
            rate=1, burst=1, max_wait_s=0.2, max_waiters=4, clock=asyncio.get_running_loop().time
        )
        assert await budget.acquire()
        refused = await budget.acquire()
        return refused, budget.retry_after_s()

    refused, retry_after = asyncio.run(scenario())

    assert refused is False
    assert retry_after == 1


def test_budget_refuses_at_once_beyond_max_waiters():
    async def scenario():
        budget = FallbackBudget(
            rate=5, burst=1, max_wait_s=5, max_waiters=1, clock=asyncio.get_running_loop().time
        )
        assert await budget.acquire()
        waiter = asyncio.create_task(budget.acquire())
        await asyncio.sleep(0)
        refused = await budget.acquire()
        return refused, await waiter

    assert asyncio.run(scenario()) == (False, True)


SETTINGS = TuningSettings(raise_at=0.9, lower_at=0.6, step=2.0, max_factor=4.0, queue_high_water=8)


def test_pressure_is_worst_of_link_and_queue():
    assert site_pressure(0.35, 0.7, 0, 8) == 0.5
    assert site_pressure(0.1, 0.7, 8, 8) == 1.0
    assert site_pressure(0.1, 0.0, 0, 8) == 1.0


def test_tuner_raises_under_pressure_up_to_bound_and_comes_back():
    tuner = ThresholdTuner(SETTINGS)

    changes = [tuner.update(p) for p in [0.95, 0.95, 0.95, 0.7, 0.5, 0.5, 0.5]]

    assert changes == [(1.0, 2.0), (2.0, 4.0), None, None, (4.0, 2.0), (2.0, 1.0), None]
    assert tuner.effective(4096) == 4096


def test_tuner_relaxes_without_remote_site():
    tuner = ThresholdTuner(SETTINGS)
    tuner.update(1.0)

    assert tuner.effective(1000) == 2000
    assert tuner.update(None) == (2.0, 1.0)
