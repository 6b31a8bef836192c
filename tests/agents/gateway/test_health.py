"""Pool health as a pure state machine (hand-driven clock): outlier ejection growing with
repeated ejections, the ejection percentage that never takes a pool's last instance, active
probe thresholds, and what the router makes of it (decode choice, the site breaker)."""

from agents.gateway.config import GatewaySettings, parse_snapshot
from agents.gateway.health import HealthSettings, PoolHealth, pick
from agents.gateway.state import Router
from tests.agents.gateway.clock import Clock
from tests.agents.gateway.snapshots import snapshot

HEALTH = HealthSettings(
    consecutive_failures=3,
    base_ejection_s=5.0,
    max_ejection_s=12.0,
    max_ejection_percent=50.0,
    unhealthy_threshold=2,
    healthy_threshold=2,
)


def make_pool(*urls: str) -> tuple[PoolHealth, Clock]:
    clock = Clock(100.0)
    return PoolHealth("decode", "local", urls, HEALTH, clock), clock


def fail(pool: PoolHealth, url: str, times: int) -> list[bool]:
    return [pool.failure(url, "connect") for _ in range(times)]


def test_consecutive_failures_eject_for_a_time_that_grows_with_each_ejection():
    pool, clock = make_pool("http://a", "http://b")

    assert fail(pool, "http://a", 3) == [False, False, True]
    assert not pool.available("http://a")
    clock.now += 5.0
    assert pool.available("http://a")
    assert fail(pool, "http://a", 3)[-1] is True
    clock.now += 9.9
    assert not pool.available("http://a")  # second ejection: 10 s
    clock.now += 0.1
    assert pool.available("http://a")
    fail(pool, "http://a", 3)
    clock.now += 11.9
    assert not pool.available("http://a")  # third: 15 s, capped at 12 s
    clock.now += 0.1
    assert pool.available("http://a")
    assert pool.snapshot()["instances"][0]["ejections"] == 3


def test_a_success_between_failures_restarts_the_count():
    pool, _ = make_pool("http://a", "http://b")

    fail(pool, "http://a", 2)
    pool.success("http://a")

    assert fail(pool, "http://a", 2) == [False, False]
    assert pool.available("http://a")


def test_the_last_available_instance_is_never_ejected_passively():
    pool, _ = make_pool("http://a", "http://b")
    single, _ = make_pool("http://only")

    fail(pool, "http://a", 3)

    assert fail(pool, "http://b", 6) == [False] * 6
    assert pool.available("http://b")
    assert fail(single, "http://only", 6) == [False] * 6
    assert single.healthy_count() == 1


def test_probes_mark_unhealthy_and_healthy_again_which_clears_an_ejection():
    pool, _ = make_pool("http://a", "http://b")
    fail(pool, "http://a", 3)

    pool.probe("http://a", False)
    assert pool.snapshot()["instances"][0]["healthy"] is True
    pool.probe("http://a", False)
    assert pool.snapshot()["instances"][0]["healthy"] is False
    pool.probe("http://a", True)
    assert not pool.available("http://a")
    pool.probe("http://a", True)

    assert pool.available("http://a")
    assert pool.healthy_count() == 2


def test_pick_prefers_available_then_least_loaded_and_panics_when_none_is():
    pool, _ = make_pool("http://a", "http://b", "http://c")
    for url in ("http://a", "http://b"):
        for _ in range(2):
            pool.probe(url, False)

    assert pick(pool, ["http://a", "http://b", "http://c"], {"http://c": 9}) == "http://c"
    assert pick(pool, ["http://a", "http://b", "http://c"], {}, frozenset({"http://c"})) in (
        "http://a",
        "http://b",
    )
    assert pick(pool, ["http://a"], {}, frozenset({"http://a"})) is None


def make_router() -> tuple[Router, Clock]:
    clock = Clock(100.0)
    router = Router(
        GatewaySettings(breaker_consecutive_failures=2, outlier_consecutive_failures=2), clock
    )
    data = snapshot(
        decode_urls=("http://d1", "http://d2"),
        prefill_sites={"a": ("http://a1", "http://a2")},
    )
    router.apply(parse_snapshot(data))
    return router, clock


def test_an_ejected_decode_instance_is_skipped_by_the_router():
    router, _ = make_router()
    config = router.config
    assert config is not None

    router.leg_failed("decode", "local", "http://d1", "connect")
    router.leg_failed("decode", "local", "http://d1", "connect")

    assert {router.pick_decode(config).url for _ in range(6)} == {"http://d2"}  # type: ignore[union-attr]
    assert router.pick_decode(config, frozenset({"http://d2"})).url == "http://d1"  # type: ignore[union-attr]


def test_one_dead_prefill_instance_does_not_open_its_site_breaker_but_a_dead_site_does():
    router, _ = make_router()
    config = router.config
    assert config is not None
    a1, a2 = config.prefill[0].instances

    for _ in range(4):
        inst = router.acquire_prefill(config, "a")
        assert inst is not None
        if inst == a1:
            router.leg_failed("prefill", "a", a1.url, "connect")
            router.record_prefill("a", a1, False, 0.1, "test", instance_fault=True)
        else:
            router.record_prefill("a", a2, True, 0.1, "test")

    assert router.site_breakers["a"].state == "closed"
    assert router.acquire_prefill(config, "a") == a2
    for _ in range(2):
        router.record_prefill("a", a2, False, 0.1, "test", instance_fault=True)
    assert router.site_breakers["a"].state == "open"


def test_apply_keeps_the_health_of_instances_that_remain():
    router, _ = make_router()
    router.leg_failed("decode", "local", "http://d1", "connect")
    router.leg_failed("decode", "local", "http://d1", "connect")

    router.apply(parse_snapshot(snapshot(version=4, decode_urls=("http://d1", "http://d3"))))

    pool = router.pool("decode", "local")
    assert pool is not None
    assert (pool.available("http://d1"), pool.available("http://d3")) == (False, True)
