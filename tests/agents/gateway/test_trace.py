"""One request traced across both sites, with real processes: a ``pdbridge gateway`` process
before a reference prefill engine and a reference decode engine whose embedded grpc_kv
receiver takes the KV over a real transfer on loopback. The request's id appears in the
gateway's, both engines' and the KV link's log lines (the transfer id too), and the gateway's
``/debug/traces/{id}`` shows its legs with times that fit together."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agents.engines.verify import make_prompt
from tests.agents.engines.conftest import start_engine
from tests.agents.gateway.procs import start_gateway
from tests.agents.gateway.snapshots import snapshot
from tests.support import deadline_in, scaled, subprocess_env

pytestmark = pytest.mark.slow

MODEL = "qwen3-next"
TOKEN = "debug-" + uuid.uuid4().hex
DEADLINE_S = 60


def _engine_args(models_dir: Path, *extra: str) -> list[str]:
    return [
        "--model", f"tiny={MODEL}", "--models-dir", str(models_dir),
        "--chunked-prefill-tokens", "64", "--threads", "1", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory):
    """(gateway, prefill engine, decode engine) processes, the KV over grpc_kv."""
    models_dir = tmp_path_factory.mktemp("models")
    work = tmp_path_factory.mktemp("trace")
    subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "engine", "build", MODEL, "--models-dir", str(models_dir)],
        check=True, env=subprocess_env(), capture_output=True, timeout=300,
    )  # fmt: skip
    decode = start_engine(
        _engine_args(models_dir, "--role", "decode", "--kv-listen", "127.0.0.1:0", "--kv-insecure"),
        work / "decode.log",
    )
    prefill = start_engine(
        _engine_args(models_dir, "--role", "prefill", "--kv-insecure"), work / "prefill.log"
    )
    data = snapshot(
        decode_urls=(decode.url,),
        prefill_sites={"remote": (prefill.url,)},
        remote_prefill_threshold_tokens=64,
    )
    data["model"]["engine_settings"] = {}
    data["pools"]["decode"]["nodes"][0]["kv_address"] = decode.ready["kv_listen"]
    data["kv_transfer"]["timeout_ms"] = 20_000
    settings = {"chars_per_token": 1.0, "prefill_timeout_s": 60, "health_check_interval_s": 0}
    gateway = start_gateway(data, settings, work, env={"PDBRIDGE_GATEWAY_DEBUG_TOKEN": TOKEN})
    yield gateway, prefill, decode
    gateway.stop()
    prefill.stop()
    decode.stop()


def _wait_for_lines(log: Path, *needles: str) -> list[str]:
    """The log's lines once every needle is in one of them (a generous deadline: lines are
    written when the request ends, not when its answer reached the client)."""
    deadline = deadline_in(DEADLINE_S)
    while True:
        lines = log.read_text(errors="replace").splitlines()
        missing = [n for n in needles if not any(n in line for line in lines)]
        if not missing:
            return lines
        if time.monotonic() > deadline:
            raise AssertionError(f"{log.name} never logged {missing}; tail: {lines[-20:]}")
        time.sleep(0.1)


async def _request(url: str, request_id: str) -> tuple[int, dict[str, str], bytes]:
    body = {"model": "tiny", "prompt": make_prompt(200, seed=7), "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=scaled(DEADLINE_S))
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def _get(url: str, token: str | None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as r:
        return r.status, await r.json()


def test_one_request_id_in_every_log_and_its_trace(sites):
    gateway, prefill, decode = sites
    rid = "trace-" + uuid.uuid4().hex

    status, headers, raw = asyncio.run(_request(gateway.url, rid))

    assert status == 200, raw
    assert headers["x-pdbridge-path"] == "remote"
    assert headers["x-request-id"] == rid
    assert raw.endswith(b"data: [DONE]\n\n")
    # The gateway: a JSON line naming the request and its transfer on success.
    gw_lines = _wait_for_lines(gateway.log, rid, "gateway.remote_served")
    served = [json.loads(x) for x in gw_lines if "gateway.remote_served" in x]
    served = [doc for doc in served if doc.get("request_id") == rid]
    assert len(served) == 1
    tid = served[0]["transfer_id"]
    assert len(tid) == 32
    assert (served[0]["site"], served[0]["decode"]) == ("remote", "dec-0")
    # The prefill engine and the KV link's sender in it.
    pf = _wait_for_lines(
        prefill.log,
        f"kv_sent request_id={rid} transfer_id={tid}",
        f"transfer_sent transfer_id={tid} request_id={rid}",
        f"request_done request_id={rid} path=prefill transfer_id={tid}",
    )
    assert pf
    # The decode engine and the KV link's receiver in it.
    dc = _wait_for_lines(
        decode.log,
        f"transfer_begun transfer_id={tid} request_id={rid}",
        f"transfer_finished transfer_id={tid} request_id={rid}",
        f"kv_imported request_id={rid} transfer_id={tid}",
        f"request_done request_id={rid} path=remote transfer_id={tid}",
    )
    assert dc

    # The trace: refused without the token, then its legs in an order that fits.
    assert asyncio.run(_get(f"{gateway.url}/debug/traces/{rid}", None))[0] == 401
    assert asyncio.run(_get(f"{gateway.url}/debug/traces/{rid}", "wrong"))[0] == 401
    code, trace = asyncio.run(_get(f"{gateway.url}/debug/traces/{rid}", TOKEN))
    assert code == 200, trace
    assert (trace["request_id"], trace["path"], trace["outcome"], trace["status"]) == (
        rid, "remote", "ok", 200,
    )  # fmt: skip
    assert (trace["site"], trace["transfer_id"], trace["fallback_cause"]) == ("remote", tid, None)
    legs = {leg["leg"]: leg for leg in trace["legs"]}
    assert list(legs) == ["queue", "prefill", "transfer", "decode", "first_token"]
    total = trace["total_ms"]
    queue, pre, xfer, dec, first = (legs[k] for k in legs)
    assert 0 <= queue["end_ms"] <= pre["start_ms"] <= pre["end_ms"]
    # The prefill answer may land just after the stream ended (it is let finish, not cut).
    assert pre["end_ms"] <= dec["first_byte_ms"] + 5000
    assert pre["start_ms"] <= xfer["start_ms"] <= xfer["end_ms"] == pre["end_ms"]
    assert (pre["site"], pre["instance"], dec["instance"]) == ("remote", "remote-pre-0", "dec-0")
    assert queue["end_ms"] <= dec["start_ms"] <= dec["first_byte_ms"] <= dec["end_ms"] == total
    assert dec["first_byte_ms"] <= first["start_ms"] == trace["first_token_ms"] <= total
    assert xfer["end_ms"] - xfer["start_ms"] == pytest.approx(
        trace["kv"]["send_seconds"] * 1000, abs=0.01
    )
    assert trace["kv"]["bytes"] > 0
    assert trace["kv"]["bytes_wire"] > 0
    assert total < scaled(DEADLINE_S) * 1000
    # The list: newest first, this request among them.
    code, listed = asyncio.run(_get(f"{gateway.url}/debug/traces?limit=5", TOKEN))
    assert code == 200
    assert listed["traces"][0]["request_id"] == rid
