"""Import checks: a decode engine refuses a transfer whose manifest is not its model's KV
layout (a segment's shape or dtype, a layer's state missing) when the header arrives, before
any byte is imported, with the error ``kv_import_refused``; the request is then served by
local prefill, directly (``fallback: local``) and through the gateway (cause
``kv_import_refused``).

The engine-side transfers are real ones into a real decode engine process over the mTLS
grpc_kv link, made by hand (``grpc_kv.api.open_transfer``) from a cache the same model
exported in this process, so that only the manifest is wrong. Through the gateway, a real
prefill engine writes the KV to a spool directory and a relay tampers with its header on the
way to the decode engine's spool."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from agents.engines.reference import kvstate, zoo
from agents.engines.reference.grpc_link import to_kv_header
from agents.engines.reference.runner import Runner, set_threads
from agents.engines.reference.transport import TransferHeader
from agents.engines.verify import compare, make_prompt
from grpc_kv import api as kv
from pdproto.kv import KV_IMPORT_REFUSED
from tests.agents.engines.client import decode_leg, get, metric, post

MODEL = "qwen3-next"  # full-attention and linear layers (conv and recurrent states)
Tamper = Callable[[kvstate.Manifest], kvstate.Manifest]


# -- tampering a manifest (what a buggy or hostile sender would declare) -----------------------
def _first(manifest: kvstate.Manifest, marker: str) -> kvstate.SegmentSpec:
    return next(s for s in manifest.segments if marker in s.name)


def _swap(manifest: kvstate.Manifest, old: kvstate.SegmentSpec, new: kvstate.SegmentSpec):
    segments = [new if s.name == old.name else s for s in manifest.segments]
    return replace(manifest, segments=segments)


def wrong_shape(manifest: kvstate.Manifest) -> kvstate.Manifest:
    """A conv state's last two dimensions swapped: the same bytes, read the wrong way."""
    conv = _first(manifest, ".conv")
    return _swap(manifest, conv, replace(conv, shape=(*conv.shape[:-2], *conv.shape[:-3:-1])))


def wrong_dtype(manifest: kvstate.Manifest) -> kvstate.Manifest:
    """An fp32 recurrent state declared float16 with twice the elements: the same bytes."""
    rec = _first(manifest, ".rec")
    assert rec.dtype == "float32"
    doubled = (*rec.shape[:-1], rec.shape[-1] * 2)
    return _swap(manifest, rec, replace(rec, dtype="float16", shape=doubled))


def missing_linear_state(manifest: kvstate.Manifest) -> kvstate.Manifest:
    """One linear layer's conv state left out (it would import as zeros)."""
    conv = _first(manifest, ".conv")
    return replace(manifest, segments=[s for s in manifest.segments if s.name != conv.name])


def _expected_reason(tamper: Tamper, manifest: kvstate.Manifest) -> str:
    if tamper is wrong_shape:
        return f"segment {_first(manifest, '.conv').name!r}: shape"
    if tamper is wrong_dtype:
        return f"segment {_first(manifest, '.rec').name!r}: dtype float16, the model's is float32"
    return f"segments missing: {_first(manifest, '.conv').name}"


# -- in process: the layout and the check ----------------------------------------------------
@pytest.fixture(scope="module")
def runners(models_dir: Path, engine_pair) -> dict[str, Runner]:
    """Every zoo model in fp32 and bf16 (weights built by the engine fixtures)."""
    set_threads(1)
    zoo.quiet_transformers()
    out = {}
    for arch in ("qwen3-next", "gemma3", "kimi-linear", "dense"):
        path = zoo.resolve_model(arch, models_dir)
        for dtype in ("float32", "bfloat16"):
            lm = zoo.load_model(path, name=arch, dtype=dtype)
            out[f"{arch}@{dtype}"] = Runner(lm, chunk_tokens=64)
    return out


def _export(runner: Runner, length: int) -> tuple[kvstate.Manifest, dict[str, bytes]]:
    ids = [256, *((7 * i) % 256 for i in range(length - 1))]
    cache, logits = runner.prefill(ids)
    manifest, segments = kvstate.export_cache(cache, len(ids), logits)
    manifest.prompt_digest = kvstate.prompt_digest(ids)
    return kvstate.Manifest.from_json(manifest.to_json()), segments


@pytest.mark.parametrize("length", [1, 100, 333])
def test_every_models_own_export_passes_its_layout(runners, length):
    """Over and under every sliding window, with and without linear layers, fp32 and bf16."""
    for name, runner in runners.items():
        manifest, _ = _export(runner, length)

        runner.layout().check(manifest)  # no exception

        assert [s.name for s in manifest.segments] == list(runner.layout().expected(length)), name


@pytest.mark.parametrize("tamper", [wrong_shape, wrong_dtype, missing_linear_state])
def test_a_tampered_manifest_is_refused_before_anything_is_imported(runners, tamper):
    runner = runners[f"{MODEL}@float32"]
    manifest, segments = _export(runner, 100)
    bad = tamper(manifest)

    with pytest.raises(kvstate.ManifestMismatch, match=_expected_reason(tamper, manifest)):
        kvstate.import_cache(runner.loaded.model.config, bad, segments, runner.layout())


def test_other_layout_differences_are_named(runners):
    runner = runners["gemma3@float32"]  # sliding and full layers
    layout = runner.layout()
    manifest, _ = _export(runner, 100)
    sliding = next(iter(layout.windows))
    full_k = next(s for s in manifest.segments if s.kind == kvstate.FULL)
    cases = {
        "layer_kinds: transfer has": replace(manifest, layer_kinds=manifest.layer_kinds[::-1]),
        "segments not in the model's layout: L99.k": replace(
            manifest, segments=[*manifest.segments, replace(full_k, name="L99.k")]
        ),
        f"segments listed twice: {full_k.name}": replace(
            manifest, segments=[*manifest.segments, full_k]
        ),
        f"segment {full_k.name!r}: shape \\[99,": _swap(
            manifest, full_k, replace(full_k, shape=(99, *full_k.shape[1:]))
        ),
        f"cumulative_lengths: layer {sliding} has 7": replace(
            manifest, cumulative_lengths={**manifest.cumulative_lengths, sliding: 7}
        ),
        "prompt_tokens: 0": replace(manifest, prompt_tokens=0),
    }

    for reason, bad in cases.items():
        with pytest.raises(kvstate.ManifestMismatch, match=reason):
            layout.check(bad)


# -- a real decode engine process over the mTLS grpc_kv link ---------------------------------
def _sender_tls(kv_certs: dict[str, list[str]]) -> kv.TLSConfig:
    opts = kv_certs["prefill-a"]
    return kv.TLSConfig(ca_file=opts[1], cert_file=opts[3], key_file=opts[5])


def send_by_hand(
    target: str,
    tls: kv.TLSConfig,
    runner: Runner,
    prompt: str,
    tamper: Tamper | None,
) -> str:
    """Export ``prompt``'s KV from ``runner`` in this process and push it to ``target`` with
    the manifest ``tamper`` makes (bytes sized to it); returns the transfer id."""
    lm = runner.loaded
    ids = lm.tokenizer.encode(prompt)
    cache, logits = runner.prefill(ids)
    manifest, segments = kvstate.export_cache(cache, len(ids), logits)
    manifest.prompt_digest = kvstate.prompt_digest(ids)
    if tamper is not None:
        manifest = tamper(manifest)
    tid = f"i-{uuid.uuid4().hex}"
    header = to_kv_header(TransferHeader(tid, tid, lm.fingerprint, manifest))

    async def push() -> None:
        async with kv.open_transfer(target, header, kv.LinkOptions(), tls) as tx:
            for spec in manifest.segments:
                await tx.send_layer(spec.name, segments[spec.name][: spec.nbytes], final=True)
            await tx.finish()

    asyncio.run(push())
    return tid


def _body(length: int, seed: int) -> dict:
    return {
        "model": MODEL,
        "prompt": make_prompt(length, seed=seed),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_an_untampered_transfer_by_hand_is_imported(runners, grpc_decode, kv_certs):
    """The control: the hand-made sender itself is right, so a refusal below is the
    manifest's."""
    body = _body(150, seed=21)
    tid = send_by_hand(
        grpc_decode.ready["kv_listen"], _sender_tls(kv_certs), runners[f"{MODEL}@float32"],
        body["prompt"], None,
    )  # fmt: skip

    status, headers, remote = decode_leg(grpc_decode.url, body, tid, 10)
    _, _, local = post(f"{grpc_decode.url}/v1/completions", body)

    assert status == 200, remote
    assert headers["x-pdbridge-path"] == "remote"
    assert compare(local, remote) == (True, 6, 6, None)


@pytest.mark.parametrize("tamper", [wrong_shape, wrong_dtype, missing_linear_state])
def test_decode_engine_refuses_a_tampered_manifest_with_its_named_error(
    runners, grpc_decode, kv_certs, tamper
):
    runner = runners[f"{MODEL}@float32"]
    body = _body(150, seed=22)
    _, text_before = get(f"{grpc_decode.url}/metrics")
    tid = send_by_hand(
        grpc_decode.ready["kv_listen"], _sender_tls(kv_certs), runner, body["prompt"], tamper
    )

    status, headers, data = decode_leg(grpc_decode.url, body, tid, 10)

    assert status == 503
    assert headers["x-pdbridge-path"] == "remote"
    assert data["error"]["type"] == "kv_transfer_error"
    assert data["error"]["code"] == KV_IMPORT_REFUSED
    manifest, _ = _export(runner, 150)
    assert _expected_reason(tamper, manifest) in data["error"]["message"]
    _, text = get(f"{grpc_decode.url}/metrics")
    labels = {"model_name": MODEL, "direction": "receive", "outcome": KV_IMPORT_REFUSED}
    refused = metric(text, "pdbridge:kv_transfers_total", **labels)
    assert refused == metric(text_before, "pdbridge:kv_transfers_total", **labels) + 1
    assert "kv_import_refused transfer_id=" + tid in grpc_decode.log.read_text()


def test_a_refused_manifest_is_served_by_local_prefill_with_the_same_tokens(
    runners, grpc_decode, kv_certs
):
    body = _body(150, seed=23)
    tid = send_by_hand(
        grpc_decode.ready["kv_listen"], _sender_tls(kv_certs), runners[f"{MODEL}@float32"],
        body["prompt"], missing_linear_state,
    )  # fmt: skip

    status, headers, served = decode_leg(grpc_decode.url, body, tid, 10, fallback="local")
    _, _, local = post(f"{grpc_decode.url}/v1/completions", body)

    assert status == 200
    assert headers["x-pdbridge-path"] == "fallback"
    assert served["pdbridge"]["fallback_reason"] == KV_IMPORT_REFUSED
    assert compare(local, served) == (True, 6, 6, None)


# -- through the gateway: a real prefill engine, its header tampered with on the way ---------
class SpoolRelay:
    """Moves every finished transfer from the prefill engine's spool to the decode engine's,
    rewriting its header's manifest with ``tamper`` first (the spool's rename keeps the
    decode engine from ever seeing a half-moved transfer)."""

    def __init__(self, source: Path, target: Path, tamper: Tamper) -> None:
        self.source, self.target, self.tamper = source, target, tamper
        self.moved: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            for entry in self.source.iterdir():
                if entry.name.endswith(".part") or not (entry / "trailer.json").exists():
                    continue
                header = json.loads((entry / "header.json").read_text())
                manifest = self.tamper(kvstate.Manifest.from_json(header["manifest"]))
                header["manifest"] = manifest.to_json()
                (entry / "header.json").write_text(json.dumps(header))
                os.replace(entry, self.target / entry.name)
                self.moved.append(entry.name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def relay(engine_pair, spool: Path, tmp_path: Path) -> Iterator[tuple[Path, SpoolRelay]]:
    source = tmp_path / "prefill-spool"
    source.mkdir()
    r = SpoolRelay(source, spool, missing_linear_state)
    yield source, r
    r.close()


def test_through_the_gateway_a_refused_manifest_falls_back_with_its_cause(engine_pair, relay):
    from tests.agents.gateway.harness import FAST, serving
    from tests.agents.gateway.snapshots import snapshot

    prefill, decode = engine_pair
    source, moved = relay
    data = snapshot(
        decode_urls=(decode.url,),
        prefill_sites={"remote": (prefill.url,)},
        remote_prefill_threshold_tokens=64,
    )
    data["model"]["name"] = MODEL
    data["model"]["engine_settings"] = {}
    data["pools"]["decode"]["nodes"][0]["kv_address"] = f"spool:{source}"
    data["kv_transfer"]["timeout_ms"] = 10_000
    settings = replace(FAST, chars_per_token=1.0, prefill_timeout_s=60, request_timeout_s=60)
    body = _body(150, seed=24)

    async def scenario() -> tuple[int, str, dict, str]:
        async with serving(data, settings) as (_, client, url):
            async with client.post(url + "/v1/completions", json=body) as r:
                status, path, doc = r.status, r.headers["x-pdbridge-path"], await r.json()
            async with client.get(url + "/metrics") as r:
                text = await r.text()
        return status, path, doc, text

    started = time.monotonic()
    status, path, served, text = asyncio.run(scenario())
    _, _, local = post(f"{decode.url}/v1/completions", body)

    assert (status, path) == (200, "fallback"), served
    assert len(moved.moved) == 1  # the remote path ran and its KV reached the decode engine
    assert metric(text, "pdbridge_gateway_fallbacks_total", cause=KV_IMPORT_REFUSED) == 1
    assert metric(text, "pdbridge_gateway_fallbacks_total", cause="kv_transfer") == 0
    assert compare(local, served) == (True, 6, 6, None)
    assert time.monotonic() - started < 30  # refused at once, not after a deadline
