"""The router around the decision core: site views from live signals, instance choice,
utilisation estimate, re-tuning, config swaps."""

import pytest

from agents.gateway.config import GatewaySettings, parse_snapshot
from agents.gateway.state import Router
from tests.agents.gateway.clock import Clock
from tests.agents.gateway.snapshots import snapshot

SETTINGS = GatewaySettings(
    breaker_consecutive_failures=2,
    breaker_ejection_base_s=10,
    utilization_window_s=5,
    kv_bytes_per_token=1000,
    retune_step=2.0,
    retune_max_factor=4.0,
)


def make_router(**routing):
    clock = Clock(100.0)
    router = Router(SETTINGS, clock)
    data = snapshot(prefill_sites={"a": ("http://a1", "http://a2"), "b": ("http://b1",)}, **routing)
    # a: 100 Mbit/s, b: 50 Mbit/s, ceiling 0.7
    data["links"][0]["provisioned_mbit_s"] = 100
    data["links"][1]["provisioned_mbit_s"] = 50
    router.apply(parse_snapshot(data))
    return router, clock


def trip_site_a(router):
    """Two failed prefill legs at site a (consecutive_failures=2 opens its breakers)."""
    a1 = router.config.prefill[0].instances[0]
    for _ in range(2):
        router.acquire_prefill(router.config, "a")
        router.record_prefill("a", a1, False, 0.1, "test")


def test_share_over_5000_requests_through_router_is_within_2_percent_and_sticky():
    router, _ = make_router(remote_share_percent=10)
    config = router.config

    first = [router.decide(config, f"user-{i}", 5000).path for i in range(5000)]
    again = [router.decide(config, f"user-{i}", 5000).path for i in range(5000)]

    share = first.count("remote") / 5000
    assert abs(share - 0.10) <= 0.02
    assert first == again


def test_best_site_by_bandwidth_then_queue():
    router, _ = make_router()
    config = router.config

    assert router.decide(config, "k", 5000).site == "a"
    router.stats["a"].scraped_queue = 3  # a: 100/(1+3) = 25 < b: 50
    assert router.decide(config, "k", 5000).site == "b"


def test_utilization_estimate_from_routed_tokens_expires_with_window():
    router, clock = make_router()

    # 43,750 tokens x 1000 B x 8 / 5 s = 70 Mbit/s on a 100 Mbit/s link: at the 0.7 ceiling.
    router.note_remote_tokens("a", 43_750)

    assert router.utilization("a", 100) == pytest.approx(0.7)
    assert router.decide(router.config, "k", 5000).site == "b"
    clock.now += 5.1
    assert router.utilization("a", 100) == 0.0
    assert router.decide(router.config, "k", 5000).site == "a"


def test_all_sites_saturated_wants_remote_with_link_saturated():
    router, _ = make_router()
    router.note_remote_tokens("a", 50_000)
    router.note_remote_tokens("b", 25_000)

    d = router.decide(router.config, "k", 5000)

    assert (d.path, d.reason, d.wants_remote) == ("local", "link_saturated", True)


def test_instance_breakers_pick_healthy_instance_and_site_stays_available():
    router, _ = make_router()
    config = router.config
    a1 = config.prefill[0].instances[0]
    for _ in range(2):
        inst = router.acquire_prefill(config, "a")
        assert inst == a1
        router.instance_breakers[a1.url].record(False, 0.1)
        router.site_breakers["a"].record(True, 0.1)

    chosen = router.acquire_prefill(config, "a")

    assert chosen.url == "http://a2"
    assert router.instance_breakers[a1.url].state == "open"
    assert router.decide(config, "k", 5000).site == "a"


def test_site_breaker_open_makes_site_unavailable():
    router, _ = make_router()
    config = router.config
    trip_site_a(router)

    assert router.site_breakers["a"].state == "open"
    assert router.acquire_prefill(config, "a") is None
    assert router.decide(config, "k", 5000).site == "b"


def test_least_loaded_instance_and_decode_choice():
    router, _ = make_router()
    config = router.config
    router.begin("http://a1", "a")

    assert router.acquire_prefill(config, "a").url == "http://a2"
    assert router.stats["a"].inflight == 1
    router.end("http://a1", "a")
    assert router.stats["a"].inflight == 0


def test_retune_raises_threshold_under_link_pressure_and_lowers_when_it_falls():
    router, clock = make_router()
    config = router.config
    router.note_remote_tokens("a", 40_000)  # 0.64 of 100 Mbit/s: pressure 0.91 of ceiling
    router.note_remote_tokens("b", 20_000)  # 0.64 of 50 Mbit/s

    assert router.retune() == (1.0, 2.0)
    assert router.decide(config, "k", 150).reason == "below_threshold"
    assert router.debug()["effective_threshold_tokens"] == 200
    clock.now += 6
    assert router.retune() == (2.0, 1.0)
    assert router.decide(config, "k", 150).path == "remote"


def test_retune_on_queue_pressure():
    router, _ = make_router()
    router.stats["a"].scraped_queue = 8
    router.stats["b"].scraped_queue = 10

    assert router.retune() == (1.0, 2.0)


def test_apply_keeps_breaker_state_of_remaining_sites_and_drops_removed():
    router, _ = make_router()
    trip_site_a(router)
    data = snapshot(prefill_sites={"a": ("http://a1",)}, version=4)

    router.apply(parse_snapshot(data))

    assert router.site_breakers["a"].state == "open"
    assert set(router.site_breakers) == {"a"}
    assert set(router.instance_breakers) == {"http://a1"}


def test_debug_document_lists_sites_instances_and_breakers():
    router, _ = make_router()

    doc = router.debug()

    assert doc["config"]["version"] == 3
    assert [s["site"] for s in doc["sites"]] == ["a", "b"]
    assert doc["sites"][0]["breaker"]["state"] == "closed"
    assert [i["url"] for i in doc["sites"][0]["instances"]] == ["http://a1", "http://a2"]
    assert doc["decode"]["instances"][0]["kv_address"] == "127.0.0.1:7100"


def test_a_slow_site_loses_the_score_to_its_latency_before_its_breaker_opens():
    router, _ = make_router()
    config = router.config
    router.record_latency("b", 0.05)
    assert router.decide(config, "k", 5000).site == "a"  # a: unmeasured, twice b's link

    router.record_latency("a", 2.0)  # one leg that ran into its site timeout

    assert router.decide(config, "k", 5000).site == "b"
    assert router.site_breakers["a"].state == "closed"
    doc = {s["site"]: s for s in router.debug()["sites"]}
    assert doc["a"]["prefill_latency_s"] == 2.0
    assert doc["a"]["latency_factor"] == pytest.approx(0.1 / 2.1, abs=1e-4)
    assert doc["a"]["score"] < doc["b"]["score"]


def test_a_slow_site_penalty_fades_without_samples_so_it_is_tried_again():
    router, clock = make_router()
    router.record_latency("b", 0.1)
    router.record_latency("a", 2.0)
    assert router.decide(router.config, "k", 5000).site == "b"

    clock.now += 4 * SETTINGS.prefill_latency_halflife_s  # a's penalty down to 1/16

    factors = router.latency_factors(router.config)
    assert factors["a"] == pytest.approx(1 - (1 - 0.1 / 2.1) / 16)
    assert router.decide(router.config, "k", 5000).site == "a"


def test_next_site_leaves_out_the_sites_tried_and_those_that_cannot_take_it():
    router, _ = make_router()
    config = router.config

    assert router.next_site(config, frozenset({"a"})) == "b"
    assert router.next_site(config, frozenset({"a", "b"})) is None
    trip_site_a(router)
    assert router.next_site(config, frozenset({"b"})) is None


def test_retune_from_measured_ttft_is_recorded_with_its_reason_in_debug():
    router, _ = make_router()
    config = router.config
    for _ in range(5):
        router.ttft_sample(config, "local", 100, 0.05)
        router.ttft_sample(config, "remote", 150, 0.3)

    assert router.retune() == (1.0, 2.0)

    tuning = router.debug()["tuning"]
    [change] = tuning["changes"]
    assert {k: change[k] for k in ("factor_from", "factor_to", "threshold_tokens", "reason")} == {
        "factor_from": 1.0,
        "factor_to": 2.0,
        "threshold_tokens": 200,
        "reason": "ttft",
    }
    assert change["ttft_ratio"] == pytest.approx(4.0)
    assert change["at"].endswith("+00:00")
    assert tuning["ttft"]["ratio"] == pytest.approx(4.0)


def _drain(data, site_index, node_index, drained=True):
    node = data["pools"]["prefill"][site_index]["nodes"][node_index]
    if drained:
        node["drained"] = True
    else:
        node.pop("drained", None)
    data["version"] += 1
    return parse_snapshot(data)


def _data():
    data = snapshot(prefill_sites={"a": ("http://a1", "http://a2"), "b": ("http://b1",)})
    data["links"][0]["provisioned_mbit_s"] = 100
    data["links"][1]["provisioned_mbit_s"] = 50
    return data


def test_a_drained_instance_gets_no_leg_and_is_neither_probed_nor_a_fault():
    router = Router(SETTINGS, Clock(100.0))
    data = _data()
    router.apply(_drain(data, 0, 0))
    config = router.config

    chosen = {router.acquire_prefill(config, "a").url for _ in range(5)}

    assert chosen == {"http://a2"}
    pool = router.pool("prefill", "a")
    assert pool.in_rotation() == ["http://a2"]
    assert (pool.available("http://a1"), pool.healthy_count()) == (False, 1)
    assert pool.snapshot()["drained"] == 1
    assert router.decide(config, "k", 5000).site == "a"  # the site serves on a2
    doc = router.debug()["sites"][0]["instances"]
    assert [(i["url"], i["drained"]) for i in doc] == [("http://a1", True), ("http://a2", False)]


def test_a_site_drained_to_zero_is_no_remote_site_and_its_breaker_stays_closed():
    router = Router(SETTINGS, Clock(100.0))
    data = _data()
    del data["pools"]["prefill"][1]  # only site a
    router.apply(_drain(data, 0, 0))
    config = _drain(data, 0, 1)
    router.apply(config)

    decision = router.decide(config, "k", 5000)

    assert (decision.path, decision.reason) == ("local", "no_remote_site")
    assert router.site_breakers["a"].state == "closed"
    assert router.debug()["sites"][0]["available"] is False


def test_an_instance_that_rejoins_after_a_drain_starts_afresh():
    clock = Clock(100.0)
    router = Router(SETTINGS, clock)
    data = _data()
    router.apply(parse_snapshot(data))
    a1 = router.config.prefill[0].instances[0]
    for _ in range(2):  # the engine that is about to be stopped failed twice
        router.acquire_prefill(router.config, "a")
        router.record_prefill("a", a1, False, 0.1, "test")
    router.probed("prefill", "a", a1.url, False)
    assert router.instance_breakers[a1.url].state == "open"

    router.apply(_drain(data, 0, 0))
    router.apply(_drain(data, 0, 0, drained=False))  # relaunched, healthy: rejoins

    assert router.instance_breakers[a1.url].state == "closed"
    pool = router.pool("prefill", "a")
    assert pool.available(a1.url)
    assert pool.instances[a1.url].probe_failures == 0


def test_an_ejected_prefill_instance_opens_its_own_breaker_not_the_sites():
    router = Router(GatewaySettings(outlier_consecutive_failures=3), Clock(100.0))
    router.apply(parse_snapshot(_data()))
    config = router.config
    a1 = config.prefill[0].instances[0]

    for _ in range(3):  # a dead engine: three legs refused at a1
        router.acquire_prefill(config, "a")
        router.leg_failed("prefill", "a", a1.url, "connect")
        router.record_prefill("a", a1, False, 0.01, "remote_leg", instance_fault=True)

    assert router.pool("prefill", "a").available(a1.url) is False
    assert router.instance_breakers[a1.url].state == "open"
    assert router.instance_breakers[a1.url].last_reason == "ejected"
    assert router.site_breakers["a"].state == "closed"
    assert router.site_breakers["a"].snapshot()["window_requests"] == 0
    assert {router.acquire_prefill(config, "a").url for _ in range(4)} == {"http://a2"}


def _router_with_local_pool():
    """Sites a (100 Mbit/s) and b (50 Mbit/s) and a prefill pool at the decode site ("local")
    with no link: once scored at a notional 1,000 Mbit/s, it would have won every time."""
    clock = Clock(100.0)
    router = Router(SETTINGS, clock)
    data = snapshot(
        prefill_sites={
            "a": ("http://a1",),
            "b": ("http://b1",),
            "local": ("http://l1", "http://l2"),
        }
    )
    data["links"] = [link for link in data["links"] if link["from_site"] != "local"]
    data["links"][0]["provisioned_mbit_s"] = 100
    data["links"][1]["provisioned_mbit_s"] = 50
    router.apply(parse_snapshot(data))
    return router, clock


def test_the_local_prefill_pool_is_never_a_remote_site_nor_failed_over_to():
    router, _ = _router_with_local_pool()
    config = router.config

    assert [v.name for v in router.site_views(config)] == ["a", "b"]
    assert router.decide(config, "k", 5000).site == "a"
    assert router.next_site(config, frozenset({"a"})) == "b"
    assert router.next_site(config, frozenset({"a", "b"})) is None
    assert set(router.site_breakers) == {"a", "b"}
    assert set(router.stats) == {"a", "b"}
    assert router.note_remote_tokens("local", 1000) is None
    debug = router.debug()
    assert [s["site"] for s in debug["sites"]] == ["a", "b"]
    assert debug["local_prefill"]["site"] == "local"
    assert [i["url"] for i in debug["local_prefill"]["instances"]] == ["http://l1", "http://l2"]


def test_local_prefill_instances_have_breakers_and_pool_health_as_remote_ones():
    router, _ = _router_with_local_pool()
    config = router.config
    l1, l2 = config.local_prefill.instances

    assert ("prefill", "local") in router.pools
    assert router.acquire_local_prefill(config) == l1
    router.record_prefill("local", l1, False, 0.1, "test")
    router.acquire_local_prefill(config)
    router.record_prefill("local", l1, False, 0.1, "test")  # consecutive_failures=2: open

    assert router.instance_breakers[l1.url].state == "open"
    assert router.acquire_local_prefill(config) == l2
    router.pools[("prefill", "local")].probe(l2.url, False)
    router.pools[("prefill", "local")].probe(l2.url, False)  # unhealthy
    assert router.acquire_local_prefill(config) is None
    assert router.local_prefill_in_rotation(config) is True
    assert router.debug()["local_prefill"]["available"] is False


def test_without_a_local_prefill_pool_nothing_is_acquired_or_shown():
    router, _ = make_router()

    assert router.acquire_local_prefill(router.config) is None
    assert router.local_prefill_in_rotation(router.config) is False
    assert router.debug()["local_prefill"] is None
