import pytest

from agents.gateway.breaker import BreakerSettings, CircuitBreaker
from tests.agents.gateway.clock import Clock

SETTINGS = BreakerSettings(
    error_rate_limit=0.05,
    latency_p99_limit_s=2.5,
    window_s=30,
    min_requests=20,
    consecutive_failures=5,
    ejection_base_s=5,
    ejection_cap_s=40,
    ejection_decay_s=40,
    half_open_probes=1,
    close_after_successes=3,
)


@pytest.fixture
def clock():
    return Clock(1000.0)


@pytest.fixture
def breaker(clock):
    return CircuitBreaker("remote", SETTINGS, clock)


def feed(breaker, oks, latency=0.1):
    for ok in oks:
        assert breaker.try_acquire()
        breaker.record(ok, latency)


def test_starts_closed_and_allows(breaker):
    assert breaker.state == "closed"
    assert breaker.allows()


def test_error_rate_over_limit_opens(breaker):
    # 19 successes + 1 failure = 5 %: not over the limit; a second failure is.
    feed(breaker, [True] * 19 + [False])
    assert breaker.state == "closed"

    feed(breaker, [False])

    assert breaker.state == "open"
    assert breaker.last_reason == "error_rate"
    assert not breaker.allows()
    assert not breaker.try_acquire()


def test_error_rate_needs_min_requests(breaker):
    feed(breaker, [True] * 10 + [False] * 4)

    assert breaker.state == "closed"


def test_consecutive_failures_open_without_min_requests(breaker):
    feed(breaker, [False] * 4)
    assert breaker.state == "closed"

    feed(breaker, [False])

    assert (breaker.state, breaker.last_reason) == ("open", "consecutive_failures")


def test_success_resets_consecutive_count(breaker):
    feed(breaker, [False] * 4 + [True] + [False] * 4)

    assert breaker.state == "closed"


def test_p99_latency_over_limit_opens(breaker):
    feed(breaker, [True] * 99, latency=0.1)
    assert breaker.state == "closed"

    feed(breaker, [True] * 2, latency=3.0)

    assert (breaker.state, breaker.last_reason) == ("open", "latency_p99")


def test_one_slow_request_in_a_hundred_does_not_open(breaker):
    feed(breaker, [True] * 99, latency=0.1)

    feed(breaker, [True], latency=3.0)

    assert breaker.state == "closed"


def test_old_outcomes_leave_the_window(breaker, clock):
    # Two failures in four: under min_requests, so no verdict yet; kept, they would tip the
    # next twenty outcomes over 5 %.
    feed(breaker, [True, False] * 2)
    clock.now += 31
    feed(breaker, [True] * 19 + [False])

    assert breaker.state == "closed"


def test_half_open_after_ejection_allows_one_probe(breaker, clock):
    feed(breaker, [False] * 5)
    clock.now += 4.9
    assert breaker.state == "open"

    clock.now += 0.2

    assert breaker.state == "half_open"
    assert breaker.try_acquire()
    assert not breaker.allows()
    assert not breaker.try_acquire()


def test_half_open_closes_after_successes(breaker, clock):
    feed(breaker, [False] * 5)
    clock.now += 5

    for _ in range(3):
        assert breaker.try_acquire()
        breaker.record(True, 0.1)

    assert breaker.state == "closed"
    assert breaker.last_reason == "recovered"


def test_probe_failure_reopens_with_doubled_ejection(breaker, clock):
    feed(breaker, [False] * 5)
    clock.now += 5
    assert breaker.try_acquire()

    breaker.record(False, 0.1)

    assert breaker.state == "open"
    clock.now += 9.9
    assert breaker.state == "open"
    clock.now += 0.1
    assert breaker.state == "half_open"


def test_ejection_grows_then_caps(breaker, clock):
    durations = []
    feed(breaker, [False] * 5)
    for _ in range(6):
        start = clock.now
        while breaker.state == "open":
            clock.now += 1
        durations.append(clock.now - start)
        assert breaker.try_acquire()
        breaker.record(False, 0.1)

    assert durations == [5, 10, 20, 40, 40, 40]
    assert breaker.total_ejections == 7


def test_ejection_count_decays_after_staying_closed(breaker, clock):
    feed(breaker, [False] * 5)
    clock.now += 5
    feed(breaker, [True] * 3)
    assert breaker.state == "closed"
    clock.now += 41
    feed(breaker, [True])

    feed(breaker, [False] * 5)

    start = clock.now
    while breaker.state == "open":
        clock.now += 1
    assert clock.now - start == 5


def test_the_defaults_bring_traffic_back_within_the_cap_yet_remember_a_flapping_target(clock):
    """Defaults: a long outage is probed every 8 s at most, so traffic returns within 10 s of
    the fault clearing (the trial request's own time included); closed for less than the
    120 s decay, the next trip starts at the cap."""
    breaker = CircuitBreaker("remote", BreakerSettings(), clock)
    feed(breaker, [False] * 5)
    durations = []
    for _ in range(4):  # the outage goes on: every half-open probe fails
        start = clock.now
        while breaker.state == "open":
            clock.now += 1
        durations.append(clock.now - start)
        assert breaker.try_acquire()
        breaker.record(False, 0.1)
    assert durations == [5, 8, 8, 8]
    while breaker.state == "open":  # the fault cleared during this ejection
        clock.now += 1
    feed(breaker, [True] * 3)
    assert breaker.state == "closed"

    clock.now += 60  # flaps again within the decay
    feed(breaker, [False] * 5)
    start = clock.now
    while breaker.state == "open":
        clock.now += 1
    assert clock.now - start == 8


def test_release_frees_probe_slot(breaker, clock):
    feed(breaker, [False] * 5)
    clock.now += 5
    assert breaker.try_acquire()

    breaker.release()

    assert breaker.try_acquire()


def test_late_outcome_while_open_is_ignored(breaker):
    feed(breaker, [False] * 5)

    breaker.record(True, 0.1)

    assert breaker.state == "open"


def test_snapshot_reports_window(breaker):
    feed(breaker, [True] * 3 + [False], latency=0.2)

    snap = breaker.snapshot()

    assert snap["state"] == "closed"
    assert snap["window_requests"] == 4
    assert snap["window_error_rate"] == 0.25
    assert snap["window_p99_s"] == 0.2
    assert snap["consecutive_failures"] == 1
