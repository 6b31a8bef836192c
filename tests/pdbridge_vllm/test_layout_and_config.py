"""The connector's vLLM-free parts, in the project's own environment: which positions of which
KV-cache group a transfer carries, the manifest it declares, the decode side's layout check,
the validation of ``kv_connector_extra_config``, and where the link's thread may run."""

from __future__ import annotations

import json
import os

import pytest

from grpc_kv import api as kv
from grpc_kv.api import LayerKind
from pdbridge_vllm.config import ConfigError, ConnectorConfig, model_fingerprint
from pdbridge_vllm.layout import LAYOUT_VERSION, GroupLayout, KvLayout, LayerPages
from pdbridge_vllm.runtime import Runtime


def _layout(window_blocks: int = 2) -> KvLayout:
    full = LayerPages("attn.0", 1024, "float32", (2, 128, 2), LayerKind.FULL)
    sliding = LayerPages("attn.1", 1024, "float32", (2, 128, 2), LayerKind.SLIDING)
    conv = LayerPages("gdn.0#0", 96, "bfloat16", (3, 16), LayerKind.CONV_STATE)
    ssm = LayerPages("gdn.0#1", 512, "bfloat16", (2, 8, 16), LayerKind.LINEAR_STATE)
    return KvLayout(
        (
            GroupLayout("full", 128, 0, (full,)),
            GroupLayout("sliding", 128, window_blocks, (sliding,)),
            GroupLayout("state", 128, 0, (conv, ssm)),
        )
    )


@pytest.mark.parametrize(
    ("tokens", "full", "sliding"),
    [(1, range(1), range(1)), (128, range(1), range(1)), (129, range(2), range(2)),
     (300, range(3), range(1, 3)), (1000, range(8), range(6, 8))],
)  # fmt: skip
def test_positions_full_every_block_sliding_the_window_tail_state_one(tokens, full, sliding):
    layout = _layout()
    assert layout.groups[0].positions(tokens) == full
    assert layout.groups[1].positions(tokens) == sliding
    assert layout.groups[2].positions(tokens) == range(1)


def test_ready_until_counts_whole_blocks_then_the_partial_last_one():
    full = _layout().groups[0]
    assert full.ready_until(100, 300) == 0
    assert full.ready_until(256, 300) == 2
    assert full.ready_until(300, 300) == 3
    state = _layout().groups[2]
    assert state.ready_until(299, 300) == 0
    assert state.ready_until(300, 300) == 1


def test_manifest_declares_each_tensor_and_the_first_attention_layer_is_found():
    layout = _layout()
    specs = {s.name: s for s in layout.manifest(300)}
    assert specs["attn.0"].length == 3 * 1024
    assert specs["attn.1"].length == 2 * 1024  # the window's tail only
    assert specs["gdn.0#0"].length == 96
    assert specs["gdn.0#1"].kind is LayerKind.LINEAR_STATE
    assert layout.bytes_for(300) == 3 * 1024 + 2 * 1024 + 96 + 512
    assert layout.first_attention().name == "attn.0"
    assert layout.group_of("gdn.0") == 2
    assert layout.group_of("nope") is None


def test_the_decode_side_refuses_another_layout_or_token_count_before_writing():
    layout = _layout()
    attr = layout.to_attr(300)
    assert layout.check_attr(attr, 300) is None
    assert "300 tokens" in layout.check_attr(attr, 299)
    assert "layout differs" in _layout(window_blocks=3).check_attr(attr, 300)
    assert "no pdbridge.vllm.layout" in layout.check_attr(None, 300)
    assert "not JSON" in layout.check_attr("{", 300)
    other = json.loads(attr)
    other["version"] = LAYOUT_VERSION + 1
    assert "version" in layout.check_attr(json.dumps(other), 300)


def test_config_defaults_and_every_bad_key_is_named(monkeypatch, tmp_path):
    for var in ("PDBRIDGE_KV_TLS_CA", "PDBRIDGE_KV_TLS_CERT", "PDBRIDGE_KV_TLS_KEY"):
        monkeypatch.delenv(var, raising=False)
    config = ConnectorConfig.from_extra({"insecure": True, "link": {"timeout_ms": 9000}})
    assert config.link.timeout_ms == 9000
    assert config.deadline_s == 15.0
    assert not config.faults
    assert config.link_cpus is None
    assert ConnectorConfig.from_extra({"insecure": True, "link_cpus": [0]}).link_cpus == (0,)
    bad = [
        ({"insecure": True, "colour": 1}, "unknown key"),
        ({}, "tls_ca/tls_cert/tls_key"),
        ({"insecure": "yes"}, "insecure"),
        ({"insecure": True, "deadline_s": 0}, "deadline_s"),
        ({"insecure": True, "link": {"timeout_ms": -1}}, "link.timeout_ms"),
        ({"insecure": True, "link": {"warp": 9}}, "link: unknown"),
        ({"insecure": True, "link": []}, "link: an object"),
        ({"insecure": True, "allowed_peers": "a"}, "allowed_peers"),
        ({"insecure": True, "fingerprint": "abc"}, "fingerprint"),
        ({"insecure": True, "link_cpus": []}, "link_cpus"),
        ({"insecure": True, "link_cpus": [0, -1]}, "link_cpus"),
        ({"insecure": True, "link_cpus": "0-3"}, "link_cpus"),
        ({"insecure": True, "link_cpus": [True]}, "link_cpus"),
    ]
    for extra, needle in bad:
        with pytest.raises(ConfigError, match=needle.replace("/", ".")):
            ConnectorConfig.from_extra(extra)
    monkeypatch.setenv("PDBRIDGE_KV_TLS_CA", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("PDBRIDGE_KV_TLS_CERT", str(tmp_path / "n.pem"))
    monkeypatch.setenv("PDBRIDGE_KV_TLS_KEY", str(tmp_path / "n-key.pem"))
    assert ConnectorConfig.from_extra({}).tls_ca == str(tmp_path / "ca.pem")


def test_model_fingerprint_hashes_weights_and_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"b": 1, "a": 2}))
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    first = model_fingerprint(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"other")
    assert model_fingerprint(str(tmp_path)).weights_sha256 != first.weights_sha256
    assert model_fingerprint(str(tmp_path)).arch_hash == first.arch_hash
    with pytest.raises(ConfigError, match="fingerprint"):
        model_fingerprint(str(tmp_path / "missing"))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_the_link_thread_is_not_kept_on_the_core_its_creator_was_bound_to():
    """vLLM's CPU worker binds itself to one core before the connector starts its loop thread;
    that thread (and grpc's, started from it) would inherit the binding and share the core with
    the forward pass. The runtime widens its own thread to every CPU (or ``link_cpus``)."""
    everything = os.sched_getaffinity(0)
    first = min(everything)
    os.sched_setaffinity(0, {first})  # as vLLM binds its worker
    try:
        for cpus, expected in ((None, everything), ((first,), {first})):
            runtime = Runtime(kv.LinkOptions(), kv.TLSConfig.development(), cpus)
            try:

                async def affinity() -> set[int]:
                    return os.sched_getaffinity(0)

                assert runtime.call(affinity()) == expected
            finally:
                runtime.close()
        assert os.sched_getaffinity(0) == {first}  # the creator's binding is its own
    finally:
        os.sched_setaffinity(0, everything)
