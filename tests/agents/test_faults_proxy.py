"""Link faults through the agent's userspace fault proxy (no privilege needed): a cut that
expires by itself, latency, and connection resets, with real TCP traffic through the proxy."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agents.proto.api import pb
from tests.agents.conftest import AgentProc, agent_config, free_port, stub
from tests.agents.test_grpc_api import T, settings
from tests.support import wait_for


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture(scope="module")
def echo() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def round_trip(port: int, payload: bytes = b"ping", timeout: float = 2.0) -> float | None:
    """Seconds for one echo through the proxy, or None when the path is cut."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                got += chunk
    except OSError:
        return None
    return time.monotonic() - started if got == payload else None


@pytest.fixture
def proxied(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, echo: int
) -> tuple[AgentProc, int]:
    listen = free_port()
    proxies = {"remote": {"listen": f"127.0.0.1:{listen}", "upstream": f"127.0.0.1:{echo}"}}
    agent = agent_factory(agent_config(tmp_path, None, faults={"proxies": proxies}))
    assert round_trip(listen) is not None
    return agent, listen


def _inject(agent: AgentProc, kind: str, duration_s: float, **params: Any) -> Any:
    request = pb.InjectFaultRequest(
        request_id=os.urandom(8).hex(),
        kind=kind,
        target="remote",
        duration_s=duration_s,
        params=settings(**params),
    )
    return stub(agent, None).InjectFault(request, timeout=T).fault


def test_proxy_cut_expires_by_itself(proxied: tuple[AgentProc, int]) -> None:
    agent, port = proxied
    fault = _inject(agent, "link_cut", 2)
    assert fault.mechanism == "proxy"
    assert round_trip(port) is None
    wait_for(lambda: round_trip(port) is not None, 10)
    assert list(stub(agent, None).Status(pb.StatusRequest(), timeout=T).faults) == []


def test_proxy_latency_and_resets_until_cleared(proxied: tuple[AgentProc, int]) -> None:
    agent, port = proxied
    fault = _inject(agent, "link_degrade", 60, latency_ms=300)
    delay = round_trip(port)
    assert delay is not None
    assert delay >= 0.6  # 300 ms each way
    stub(agent, None).ClearFault(
        pb.ClearFaultRequest(request_id=os.urandom(8).hex(), id=fault.id), timeout=T
    )
    fast = round_trip(port)
    assert fast is not None
    assert fast < 0.6

    fault = _inject(agent, "link_degrade", 60, reset_after_kb=1)
    assert round_trip(port, b"x" * 100) is not None  # under the budget
    assert round_trip(port, b"x" * 4096) is None  # reset after 1 KiB
    stub(agent, None).ClearFault(
        pb.ClearFaultRequest(request_id=os.urandom(8).hex(), id=fault.id), timeout=T
    )
    assert round_trip(port, b"x" * 4096) is not None


def echoed(port: int, payload: bytes) -> bytes:
    """What comes back through the proxy (the echo server returns what it received)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    return got


def test_proxy_corrupts_bytes_towards_the_peer_until_cleared(
    proxied: tuple[AgentProc, int],
) -> None:
    agent, port = proxied
    payload = bytes(range(256)) * 12  # 3 KiB
    fault = _inject(agent, "link_degrade", 60, corrupt_every_kb=1)

    got = echoed(port, payload)

    assert fault.mechanism == "proxy"
    assert [i for i in range(len(payload)) if got[i] != payload[i]] == [1024, 2048]
    assert got[1024] == payload[1024] ^ 0xFF
    stub(agent, None).ClearFault(
        pb.ClearFaultRequest(request_id=os.urandom(8).hex(), id=fault.id), timeout=T
    )
    assert echoed(port, payload) == payload


def test_proxy_fault_input_errors(proxied: tuple[AgentProc, int]) -> None:
    agent, _ = proxied
    cases = [
        ({"mode": "gently"}, "link_cut", "params.mode: reset or blackhole"),
        ({"latency_ms": -5}, "link_degrade", "params.latency_ms: must be a positive number"),
        ({"colour": "red"}, "link_degrade", "params.colour: unknown parameter of link_degrade"),
        (
            {},
            "link_degrade",
            "params: one of rate_mbit, latency_ms, reset_after_kb, corrupt_every_kb is required",
        ),
        (
            {"corrupt_every_kb": 0},
            "link_degrade",
            "params.corrupt_every_kb: must be a positive number",
        ),
    ]
    for params, kind, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            _inject(agent, kind, 5, **params)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == message
    request = pb.InjectFaultRequest(
        request_id=os.urandom(8).hex(), kind="link_cut", target="mars", duration_s=5
    )
    with pytest.raises(grpc.RpcError) as err:
        stub(agent, None).InjectFault(request, timeout=T)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details().startswith("target: nothing configured to act on peer site 'mars'")
