"""The engines behind grpc_kv's fault proxy (userspace, Toxiproxy-style) on the KV path:
a byte flipped on the wire never yields wrong output; a cut link fails the prefill leg with a
distinct error, and the decode leg falls back to local prefill with the same tokens a local
run gives."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agents.engines.verify import compare, make_prompt
from grpc_kv.faultproxy import Bandwidth, FaultProxy, Flip
from tests.agents.engines.client import decode_leg, post, prefill_leg
from tests.support import connections_to, deadline_in


class ProxyThread:
    """A FaultProxy on its own event loop in a daemon thread; ``call`` runs a function there."""

    def __init__(self, upstream: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = FaultProxy(upstream=upstream)
        port = asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        self.address = f"127.0.0.1:{port}"

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def proxy(grpc_decode) -> Iterator[ProxyThread]:
    p = ProxyThread(grpc_decode.ready["kv_listen"])
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _clean(proxy):
    yield
    proxy.call(proxy.proxy.clear)


def test_flipped_byte_on_the_wire_never_yields_wrong_output(engine_pair, grpc_decode, proxy):
    """Either the link repairs the flip (remote path, identical output) or the transfer fails
    with a KV error and the decoder falls back; wrong tokens are never served."""
    prefill, _ = engine_pair
    body = {
        "model": "qwen3-next",
        "prompt": make_prompt(333, seed=5),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    flip = proxy.call(proxy.proxy.add, Flip(direction="upstream", offsets=(30_000,), limit=1))
    tid = f"f-{uuid.uuid4().hex}"

    s1, _, pre = prefill_leg(prefill.url, body, tid, proxy.address)
    s2, headers, remote = decode_leg(grpc_decode.url, body, tid, 2.0, fallback="local")
    _, _, local = post(f"{grpc_decode.url}/v1/completions", body)

    assert flip.flipped == 1
    assert s2 == 200
    if s1 == 200:
        assert headers["x-pdbridge-path"] == "remote"
    else:
        assert s1 == 503
        assert pre["error"]["type"] == "kv_transfer_error"
        assert headers["x-pdbridge-path"] == "fallback"
    assert compare(local, remote) == (True, 8, 8, None)


def test_cut_link_fails_prefill_leg_and_decode_falls_back(engine_pair, grpc_decode, proxy):
    prefill, _ = engine_pair
    body = {
        "model": "gemma3",
        "prompt": make_prompt(150, seed=9),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    proxy.call(proxy.proxy.cut, "reset")
    tid = f"f-{uuid.uuid4().hex}"

    s1, _, failed = prefill_leg(prefill.url, body, tid, proxy.address)
    s2, headers, fallback = decode_leg(grpc_decode.url, body, tid, 1.0, fallback="local")
    _, _, local = post(f"{grpc_decode.url}/v1/completions", body)

    assert s1 == 503
    assert failed["error"]["type"] == "kv_transfer_error"
    assert s2 == 200
    assert headers["x-pdbridge-path"] == "fallback"
    assert fallback["pdbridge"]["fallback_reason"] in {
        "kv_timeout",
        "kv_corrupt",
        "transfer_failed",
    }
    assert compare(local, fallback) == (True, 6, 6, None)


def test_prefill_client_gone_mid_transfer_leaves_the_pooled_link_as_it_was(
    engine_pair, grpc_decode, proxy
):
    """The gateway drops a prefill leg (timeout, fallback) while the KV is still on the wire:
    the engine ends the transfer, and its link to that receiver keeps the connections it had
    (one per ``connections``) instead of leaving a set behind per request."""
    prefill, _ = engine_pair
    port = int(proxy.address.rsplit(":", 1)[1])
    body = {"model": "qwen3-next", "prompt": make_prompt(700, seed=4), "max_tokens": 1}

    def remote_prefill(timeout: float) -> int:
        kv = {
            "do_remote_decode": True,
            "transfer_id": f"f-{uuid.uuid4().hex}",
            "kv_destination": proxy.address,
        }
        return post(f"{prefill.url}/v1/completions", {**body, "kv_transfer_params": kv}, timeout)[0]

    assert remote_prefill(60) == 200
    pooled = connections_to(port)
    proxy.call(proxy.proxy.add, Bandwidth(direction="upstream", bytes_per_s=20_000))
    with pytest.raises(TimeoutError):
        remote_prefill(1.0)
    proxy.call(proxy.proxy.clear)

    # The abandoned transfer fails at its deadline (timeout_ms) at the latest, its broken
    # streams are replaced; then the link is back to its own connections and works.
    deadline = deadline_in(15)
    while connections_to(port) > pooled and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 1 <= pooled <= 2
    assert connections_to(port) <= pooled
    assert [remote_prefill(60) for _ in range(3)] == [200, 200, 200]
    assert connections_to(port) <= pooled
