import copy

import pytest

from agents.gateway.config import (
    ConfigError,
    GatewaySettings,
    load_settings,
    load_snapshot_file,
    parse_snapshot,
    settings_from_mapping,
)
from tests.agents.gateway.snapshots import snapshot


def test_parses_contract_snapshot():
    config = parse_snapshot(snapshot())

    assert config.version == 3
    assert config.model_name == "tiny"
    assert config.max_model_len == 8192
    assert config.threshold_tokens == 100
    assert config.decode.instances[0].url == "http://127.0.0.1:9"
    assert config.decode.instances[0].kv_address == "127.0.0.1:7100"
    assert [s.name for s in config.prefill] == ["remote"]
    assert config.links["remote"].bandwidth_mbit_s == 100000
    assert config.kv_timeout_ms == 4000
    assert config.kv_mode == "push"  # absent from the snapshot: pdbridge's own convention
    assert parse_snapshot(snapshot(kv_mode="pull")).kv_mode == "pull"


def test_engine_url_defaults_from_hostname_and_pool_port():
    data = snapshot()
    node = data["pools"]["decode"]["nodes"][0]
    del node["engine_url"], node["kv_address"]
    data["pools"]["decode"]["engine_settings"] = {"port": 8100, "kv_port": 7200}

    config = parse_snapshot(data)

    assert config.decode.instances[0].url == "http://dec-0:8100"
    assert config.decode.instances[0].kv_address == "dec-0:7200"


def test_kv_host_puts_a_wan_proxy_in_front_of_the_decode_receiver():
    data = snapshot()
    node = data["pools"]["decode"]["nodes"][0]
    del node["engine_url"], node["kv_address"]
    data["pools"]["decode"]["engine_settings"] = {"port": 8100, "kv_port": 7200,
                                                  "kv_host": "10.64.0.3"}  # fmt: skip

    config = parse_snapshot(data)

    assert config.decode.instances[0].url == "http://dec-0:8100"
    assert config.decode.instances[0].kv_address == "10.64.0.3:7200"


def test_each_prefill_site_may_have_its_own_wan_path_to_the_receiver():
    data = snapshot()
    data["pools"]["decode"]["engine_settings"] = {
        "kv_site_addresses": {"remote-b": "localhost:7300"}
    }

    [decode] = parse_snapshot(data).decode.instances

    assert decode.kv_address_for("remote-b") == "localhost:7300"
    assert decode.kv_address_for("remote") == decode.kv_address == "127.0.0.1:7100"
    data["pools"]["decode"]["engine_settings"] = {"kv_site_addresses": {"remote-b": ""}}
    with pytest.raises(
        ConfigError, match=r"pools\.decode\.engine_settings\.kv_site_addresses\.remote-b"
    ):
        parse_snapshot(data)


def test_measured_bandwidth_wins_over_provisioned():
    data = snapshot()
    data["links"][0]["measured_mbit_s"] = 5000

    assert parse_snapshot(data).links["remote"].bandwidth_mbit_s == 5000


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["routing"].update(remote_share_percent=150), "routing.remote_share_percent"),
        (lambda d: d["routing"].update(kill_switch="yes"), "routing.kill_switch"),
        (
            lambda d: d["routing"].pop("remote_prefill_threshold_tokens"),
            "routing.remote_prefill_threshold_tokens",
        ),
        (lambda d: d["model"].update(name=""), "model.name"),
        (lambda d: d["pools"]["decode"].update(nodes=[]), "pools.decode.nodes"),
        (
            lambda d: d["pools"]["decode"]["nodes"][0].update(engine_url="ftp://x"),
            "pools.decode.nodes[0].engine_url",
        ),
        (lambda d: d["pools"].update(prefill={}), "pools.prefill"),
        (lambda d: d["kv_transfer"].update(mode="nixl"), "kv_transfer.mode"),
        (lambda d: d["links"][0].update(utilization_ceiling=2), "links[0].utilization_ceiling"),
        (lambda d: d.pop("deployment"), "snapshot.deployment"),
        (lambda d: d.update(routing=[1]), "routing: must be an object"),
        (lambda d: d.update(links="x"), "links: must be a list"),
        (lambda d: d.update(links=["x"]), "links[0]: must be an object"),
        (
            lambda d: d["pools"]["decode"].update(nodes=["x"]),
            "pools.decode.nodes[0]: must be an object",
        ),
        (
            lambda d: d["model"].update(engine_settings="x"),
            "model.engine_settings: must be an object",
        ),
        (
            lambda d: d["model"].update(engine_settings={"chars_per_token": 0}),
            "model.engine_settings.chars_per_token: must be > 0",
        ),
        (
            lambda d: d["model"].update(engine_settings={"chars_per_token": "1"}),
            "model.engine_settings.chars_per_token: must be a number",
        ),
    ],
)
def test_invalid_snapshot_names_the_field(mutate, field):
    data = snapshot()
    mutate(data)

    with pytest.raises(ConfigError) as error:
        parse_snapshot(data)

    assert str(error.value).startswith(field)


def test_snapshot_must_be_object():
    with pytest.raises(ConfigError, match="snapshot: must be a JSON object"):
        parse_snapshot([1, 2])


def test_settings_from_yaml(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("port: 0\nfallback_rate_per_s: 2.5\ntokenize: true\n")

    settings = load_settings(path)

    assert (settings.port, settings.fallback_rate_per_s, settings.tokenize) == (0, 2.5, True)
    assert load_settings(None) == GatewaySettings()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prot": 1}, "settings.prot: unknown setting"),
        ({"port": "x"}, "settings.port: must be a number"),
        ({"tokenize": 1}, "settings.tokenize: must be true or false"),
        ({"port": -1}, "settings.port: must be within"),
        ({"event_loop": "tokio"}, "settings.event_loop: must be one of auto, uvloop, asyncio"),
        (
            {"prefill_site_timeout_fraction": 0},
            r"settings.prefill_site_timeout_fraction: must be within \(0, 1\], got 0.0",
        ),
        ({"latency_ewma_alpha": 1.5}, r"settings.latency_ewma_alpha: must be within \(0, 1\]"),
        ({"retune_min_factor": 2}, "settings.retune_min_factor, settings.retune_max_factor"),
        ({"retune_max_factor": 0.5}, "need 0 < min <= 1 <= max, got 1.0, 0.5"),
    ],
)
def test_bad_settings_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        settings_from_mapping(data)


def test_snapshot_file(tmp_path):
    import json

    path = tmp_path / "snap.json"
    path.write_text(json.dumps(snapshot(version=9)))

    assert load_snapshot_file(path).version == 9


def test_console_shaped_snapshot_without_engine_fields_and_with_reverse_links():
    data = snapshot()
    data["pools"]["decode"] = {
        "site": "local",
        "nodes": [{"hostname": "dec-1", "agent_address": "10.0.0.5:7070"}],
        "engine_settings": {"port": 8100},
    }
    data["pools"]["prefill"] = [
        {"site": "remote", "nodes": [{"hostname": "pre-1", "agent_address": "10.1.0.5:7070"}],
         "engine_settings": {}}
    ]  # fmt: skip
    data["links"] = [
        {"from_site": "local", "to_site": "remote", "provisioned_mbit_s": 1, "measured_mbit_s": None,
         "rtt_ms": 30.0, "utilization_ceiling": 0.5},
        {"from_site": "remote", "to_site": "local", "provisioned_mbit_s": 100000,
         "measured_mbit_s": 81000.5, "rtt_ms": 30.0, "utilization_ceiling": 0.7},
    ]  # fmt: skip

    config = parse_snapshot(data)

    assert config.decode.instances[0].url == "http://dec-1:8100"
    assert config.decode.instances[0].kv_address == "dec-1:7100"
    assert config.prefill[0].instances[0].url == "http://pre-1:8000"
    assert set(config.links) == {"remote"}
    assert config.links["remote"].bandwidth_mbit_s == 81000.5


def test_snapshot_without_decode_pool_is_refused():
    data = snapshot()
    data["pools"]["decode"] = None

    with pytest.raises(ConfigError, match=r"^pools\.decode: must be an object"):
        parse_snapshot(data)


def test_a_prefill_pool_at_the_decode_site_is_the_local_prefill_pool_not_a_remote_site():
    data = snapshot(prefill_sites={"remote": ("http://r1",), "local": ("http://l1", "http://l2")})

    config = parse_snapshot(data)

    assert [site.name for site in config.prefill] == ["remote"]
    assert config.local_prefill is not None
    assert config.local_prefill.name == "local"
    assert [i.url for i in config.local_prefill.instances] == ["http://l1", "http://l2"]


def test_without_a_pool_at_the_decode_site_there_is_no_local_prefill_pool():
    config = parse_snapshot(
        snapshot(prefill_sites={"east": ("http://e1",), "west": ("http://w1",)})
    )

    assert [site.name for site in config.prefill] == ["east", "west"]
    assert config.local_prefill is None


def test_two_prefill_pools_at_one_site_are_refused():
    data = snapshot(prefill_sites={"remote": ("http://r1",)})
    data["pools"]["prefill"].append(copy.deepcopy(data["pools"]["prefill"][0]))

    with pytest.raises(ConfigError, match=r"^pools\.prefill\[1\]\.site: 'remote' has a prefill"):
        parse_snapshot(data)
