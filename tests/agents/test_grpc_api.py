"""The control API of a real agent process over mTLS: launch, status, stop, restart, logs,
idempotency, authentication, bad input, supervision and heartbeats."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct

from agents.proto.api import pb
from grpc_kv.receiver import ReceiverServer
from grpc_kv.tls import TLSConfig
from tests.agents.conftest import (
    AgentProc,
    FakeConsole,
    agent_config,
    command_pids,
    pid_alive,
    start_agent,
    stub,
)
from tests.agents.pki import Pki
from tests.support import scaled, wait_for

T = scaled(60)  # generous per-call deadline: the machine is shared


def settings(**values: Any) -> Struct:
    struct = Struct()
    struct.update(values)
    return struct


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, pki: Pki, console: FakeConsole
) -> Iterator[AgentProc]:
    tmp = tmp_path_factory.mktemp("agent")
    config = agent_config(tmp, pki, console={"url": console.url, "token": "node-secret"})
    proc = start_agent(tmp, config)
    yield proc
    assert proc.terminate() == 0


@pytest.fixture(scope="module")
def api(agent: AgentProc, pki: Pki) -> Any:
    return stub(agent, pki)


def launch(
    api: Any, name: str, engine: str = "healthy", rid: str | None = None, **values: Any
) -> Any:
    request = pb.LaunchRequest(
        request_id=rid or os.urandom(8).hex(),
        name=name,
        kind="prefill-engine",
        engine=engine,
        settings=settings(**{"tag": "a", **values}),
    )
    return api.Launch(request, timeout=T)


def inject_fault(api: Any, kind: str, target: str, duration_s: float) -> Any:
    request = pb.InjectFaultRequest(
        request_id=os.urandom(8).hex(), kind=kind, target=target, duration_s=duration_s
    )
    return api.InjectFault(request, timeout=T).fault


def child_status(api: Any, name: str) -> Any:
    return api.Status(pb.StatusRequest(name=name), timeout=T).children[0]


def test_launch_status_stop_restart(api: Any) -> None:
    first = launch(api, "pre-1")
    assert first.action == "started"
    assert first.child.state == "running"
    assert first.child.healthy
    assert pid_alive(first.child.pid)
    with urllib.request.urlopen(first.child.health_url, timeout=5) as resp:  # noqa: S310
        assert resp.status == 200

    again = launch(api, "pre-1")
    assert again.action == "unchanged"
    assert again.child.pid == first.child.pid

    rolled = launch(api, "pre-1", tag="b")
    assert rolled.action == "rolled"
    assert rolled.child.pid != first.child.pid
    assert rolled.child.healthy
    wait_for(lambda: not pid_alive(first.child.pid), 10)

    restarted = api.Restart(pb.RestartRequest(request_id="r-1", name="pre-1"), timeout=T).child
    assert restarted.state == "running"
    assert restarted.pid != rolled.child.pid
    assert restarted.restarts == 1

    status = api.Status(pb.StatusRequest(), timeout=T)
    assert status.node == "dec-1"
    assert status.site == "local"
    (mine,) = [c for c in status.children if c.name == "pre-1"]
    assert (mine.pid, mine.port, mine.healthy, mine.restarts) == (
        restarted.pid,
        restarted.port,
        True,
        1,
    )
    assert 0 < mine.uptime_s < status.uptime_s  # the child's since its (re)start, the agent's

    logs = api.Logs(pb.LogsRequest(name="pre-1", offset=0), timeout=T)
    assert b"healthserver pid=" in logs.data
    assert b"tag=b" in logs.data
    assert logs.next_offset == logs.offset + len(logs.data)
    tail = api.Logs(pb.LogsRequest(name="pre-1", offset=-20), timeout=T)
    assert len(tail.data) == 20
    assert tail.next_offset == logs.next_offset

    stopped = api.Stop(pb.StopRequest(request_id="s-1", name="pre-1"), timeout=T).child
    assert stopped.state == "stopped"
    assert not pid_alive(restarted.pid)
    with pytest.raises(grpc.RpcError) as err:
        api.Status(pb.StatusRequest(name="pre-1"), timeout=T)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_stop_escalates_to_sigkill_after_the_grace(api: Any) -> None:
    child = launch(api, "stubborn", engine="stubborn").child  # ignores SIGTERM
    (command,) = command_pids(child.pid)
    started = time.monotonic()
    stopped = api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="stubborn"), timeout=T)
    took = time.monotonic() - started
    assert stopped.child.last_exit == "signal 9"
    assert 2 <= took < 10  # supervision.stop_grace_s is 2 in these tests
    assert not pid_alive(command)


def test_request_id_makes_launch_idempotent(api: Any) -> None:
    one = launch(api, "idem", rid="same-id")
    two = launch(api, "idem", rid="same-id")
    assert one == two
    with pytest.raises(grpc.RpcError) as err:
        launch(api, "idem", rid="same-id", tag="other")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        api.Stop(pb.StopRequest(name="idem"), timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id: required" in err.value.details()
    api.Stop(pb.StopRequest(request_id="stop-idem", name="idem"), timeout=T)


def _bad_launch(api: Any, **fields: Any) -> grpc.RpcError:
    request = pb.LaunchRequest(request_id=os.urandom(8).hex(), **fields)
    with pytest.raises(grpc.RpcError) as err:
        api.Launch(request, timeout=T)
    return err.value


def test_bad_input_gets_clear_errors_and_agent_keeps_serving(api: Any) -> None:
    err = _bad_launch(api, name="x", kind="espresso-machine", engine="healthy")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("kind: unknown kind 'espresso-machine'")

    err = _bad_launch(api, name="x", kind="decode-engine")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "engine: required for kind decode-engine"

    err = _bad_launch(
        api, name="x", kind="decode-engine", engine="healthy"
    )  # {settings.tag} missing
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("settings.tag:")

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _bad_launch(
            api, name="x", kind="decode-engine", engine="plain", settings=settings(port=port)
        )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith(f"settings.port: port {port} is in use")

    err = _bad_launch(
        api, name="x", kind="decode-engine", engine="plain", config_version=99, deployment_id=1
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "config_version: deployment 1 has no config version 99"

    err = _bad_launch(api, name="x", kind="decode-engine", engine="plain", config_version=3)
    assert err.details() == "deployment_id: required with config_version"

    err = _bad_launch(api, name="x", kind="decode-engine", engine="vllm-9000")
    assert err.details() == "engine: unknown engine 'vllm-9000'"

    err = _bad_launch(api, name="x", kind="decode-engine", engine="deadborn")
    assert err.code() == grpc.StatusCode.ABORTED
    assert "ended failed (exit 7)" in err.details()

    ok = _launch_with_snapshot(api)
    assert ok.child.config_version == 3
    assert api.Status(pb.StatusRequest(), timeout=T).node == "dec-1"
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="snap"), timeout=T)


def _launch_with_snapshot(api: Any) -> Any:
    request = pb.LaunchRequest(
        request_id=os.urandom(8).hex(),
        name="snap",
        kind="decode-engine",
        engine="plain",
        config_version=3,
        deployment_id=1,
    )
    return api.Launch(request, timeout=T)


def test_kill_9_of_child_restarts_it_healthy_within_10s(api: Any) -> None:
    child = launch(api, "victim").child
    (engine_pid,) = command_pids(child.pid)  # the engine under its keeper
    os.kill(engine_pid, signal.SIGKILL)
    after = wait_for(
        lambda: (
            (c := child_status(api, "victim")).state == "running"
            and c.healthy
            and c.pid not in {0, child.pid}
            and c
        ),
        10,
    )
    assert after.restarts == 1
    assert after.last_exit == "signal 9"
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="victim"), timeout=T)


def test_crash_loop_ends_in_failed(api: Any, agent: AgentProc) -> None:
    child = launch(api, "looper", engine="crasher").child  # healthy, then exits every 0.6 s
    assert child.state == "running"
    failed = wait_for(lambda: (c := child_status(api, "looper")).state == "failed" and c, 30)
    assert failed.restarts == 2  # crash_loop_limit 3: the third crash is final
    assert failed.last_exit == "exit 3"
    assert failed.pid == 0
    # Exponential backoff between the restarts: backoff_initial_s 0.2, doubled per crash.
    events = [
        json.loads(line) for line in agent.log_path.read_text().splitlines() if line[:1] == "{"
    ]
    delays = [
        e["delay_s"]
        for e in events
        if e["event"] == "agent.child_backoff" and e["child"] == "looper"
    ]
    assert delays == [0.2, 0.4]
    restarted = api.Restart(
        pb.RestartRequest(request_id=os.urandom(8).hex(), name="looper"), timeout=T
    ).child
    assert restarted.state == "running"  # a Restart revives a failed child
    assert restarted.restarts == 3
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="looper"), timeout=T)


def test_lost_health_restarts_the_child(api: Any) -> None:
    child = launch(api, "sickly", engine="sickly").child  # answers 503 after 1 s
    after = wait_for(
        lambda: (c := child_status(api, "sickly")).restarts >= 1 and c.state == "running" and c, 20
    )
    assert after.pid != child.pid
    assert after.last_exit == "unhealthy after 2 checks (signal 15)"
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="sickly"), timeout=T)


def test_engine_restart_fault_restarts_at_once_without_counting_a_crash(api: Any) -> None:
    child = launch(api, "bounced").child
    fault = inject_fault(api, "engine_restart", "bounced", 30)
    back = wait_for(
        lambda: (
            (c := child_status(api, "bounced")).state == "running"
            and c.pid not in {0, child.pid}
            and c
        ),
        10,
    )
    assert back.restarts == 1
    assert back.healthy
    cleared = api.ClearFault(
        pb.ClearFaultRequest(request_id=os.urandom(8).hex(), id=fault.id), timeout=T
    )
    assert [f.id for f in cleared.cleared] == [fault.id]
    assert child_status(api, "bounced").pid == back.pid  # restoring it does not restart again
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="bounced"), timeout=T)


def test_engine_kill_fault_holds_child_down_until_expiry(api: Any) -> None:
    child = launch(api, "drilled").child
    fault = inject_fault(api, "engine_kill", "drilled", 2)
    assert fault.kind == "engine_kill"
    wait_for(lambda: child_status(api, "drilled").state == "held", 5)
    assert not pid_alive(child.pid)
    assert [f.id for f in api.Status(pb.StatusRequest(), timeout=T).faults] == [fault.id]
    back = wait_for(
        lambda: (c := child_status(api, "drilled")).state == "running" and c.healthy and c, 10
    )
    assert back.pid != child.pid
    assert list(api.Status(pb.StatusRequest(), timeout=T).faults) == []
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="drilled"), timeout=T)


def test_fault_input_errors(api: Any) -> None:
    def inject(**fields: Any) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            api.InjectFault(
                pb.InjectFaultRequest(request_id=os.urandom(8).hex(), **fields), timeout=T
            )
        return err.value

    assert (
        inject(kind="meteor", target="x", duration_s=1)
        .details()
        .startswith("kind: unknown fault kind")
    )
    assert (
        inject(kind="engine_kill", target="x").details()
        == "duration_s: a fault needs an expiry: duration_s > 0"
    )
    assert (
        inject(kind="engine_kill", target="x", duration_s=float("nan")).details()
        == "duration_s: a fault needs an expiry: duration_s > 0"
    )
    assert (
        inject(kind="engine_kill", target="x", duration_s=float("inf"))
        .details()
        .startswith("duration_s: at most")
    )
    assert (
        inject(kind="engine_kill", target="x", duration_s=10**6)
        .details()
        .startswith("duration_s: at most")
    )
    err = inject(kind="engine_kill", target="nobody", duration_s=1)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as cleared:
        api.ClearFault(pb.ClearFaultRequest(request_id=os.urandom(8).hex(), id="nope"), timeout=T)
    assert cleared.value.code() == grpc.StatusCode.NOT_FOUND


def test_callers_without_an_allowed_certificate_are_refused(agent: AgentProc, pki: Pki) -> None:
    plain = grpc.insecure_channel(agent.address)
    with pytest.raises(grpc.RpcError) as err:
        pb_stub(plain).Status(pb.StatusRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    with pytest.raises(grpc.RpcError) as err:
        stub(agent, pki, client="stranger").Status(pb.StatusRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # handshake fails: wrong CA

    with pytest.raises(grpc.RpcError) as err:
        stub(agent, pki, client="intruder").Status(pb.StatusRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details().startswith("caller refused: peer 'intruder' is not on the allowlist")


def pb_stub(channel: grpc.Channel) -> Any:
    from agents.proto.api import pb_grpc

    return pb_grpc.AgentControlStub(channel)


def test_heartbeats_follow_the_console_contract(
    agent: AgentProc, api: Any, console: FakeConsole
) -> None:
    launch(api, "beating")

    def latest_with_child() -> dict[str, Any] | None:
        beats = [
            b for b in console.heartbeats if any(c["name"] == "beating" for c in b["children"])
        ]
        return beats[-1] if beats else None

    beat = wait_for(latest_with_child, 10)
    assert set(beat) == {
        "agent_version",
        "clock",
        "capacity",
        "children",
        "faults",
        "config_versions",
        "agent_listen_host",
        "agent_port",
        "tls",
        "weights",
    }
    assert beat["clock"].endswith("Z")
    # Where the control API listens now (a restarted agent on another port is found there).
    assert beat["agent_port"] == int(agent.address.rsplit(":", 1)[1])
    assert (beat["tls"]["mtls"], beat["tls"]["subject"], beat["tls"]["allowlist_size"]) == (
        True,
        "dec-1",
        1,
    )
    assert beat["weights"] == []  # a custom engine without a model setting holds none
    assert beat["capacity"]["memory_gib"] > 0
    child = next(c for c in beat["children"] if c["name"] == "beating")
    assert set(child) == {
        "name",
        "kind",
        "state",
        "pid",
        "port",
        "healthy",
        "restarts",
        "config_version",
        "deployment_id",
    }
    assert child["healthy"] is True
    assert console.auth[-1] == "Bearer node-secret"
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="beating"), timeout=T)


def test_active_faults_are_reported_in_heartbeats_until_restored(
    api: Any, console: FakeConsole
) -> None:
    launch(api, "drilled-beat")
    fault = inject_fault(api, "engine_kill", "drilled-beat", 60)
    wait_for(lambda: child_status(api, "drilled-beat").state == "held", 5)
    since = len(console.heartbeats)  # beats from here on see the fault and the held child

    def beat_with_fault() -> dict[str, Any] | None:
        for beat in console.heartbeats[since:]:
            if any(f["id"] == fault.id for f in beat["faults"]):
                return beat
        return None

    beat = wait_for(beat_with_fault, 10)
    reported = next(f for f in beat["faults"] if f["id"] == fault.id)
    assert reported == {
        "id": fault.id,
        "kind": "engine_kill",
        "target": "drilled-beat",
        "expires_at": fault.expires_at,
    }
    child = next(c for c in beat["children"] if c["name"] == "drilled-beat")
    assert child["state"] == "held"
    api.ClearFault(pb.ClearFaultRequest(request_id=os.urandom(8).hex(), id=fault.id), timeout=T)
    cleared_at = len(console.heartbeats)
    wait_for(lambda: len(console.heartbeats) > cleared_at, 10)
    assert all(f["id"] != fault.id for b in console.heartbeats[cleared_at:] for f in b["faults"])
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="drilled-beat"), timeout=T)


def test_metrics_endpoint_and_child_relay(api: Any, agent: AgentProc) -> None:
    launch(api, "measured")
    base = f"http://127.0.0.1:{agent.metrics_port}"
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:  # noqa: S310
        text = resp.read().decode()
    assert 'pdbridge_agent_children_up{kind="prefill-engine"}' in text
    assert "pdbridge_agent_heartbeat_failures_total" in text
    with urllib.request.urlopen(f"{base}/children/measured/metrics", timeout=5) as resp:  # noqa: S310
        assert b"healthserver_up 1" in resp.read()
    snapshot = api.Metrics(pb.MetricsRequest(), timeout=T)
    assert "pdbridge_agent_requests_total" in snapshot.agent
    assert snapshot.child_urls["measured"] == f"{base}/children/measured/metrics"

    api.Restart(pb.RestartRequest(request_id=os.urandom(8).hex(), name="measured"), timeout=T)
    fault = inject_fault(api, "engine_kill", "measured", 60)
    text = api.Metrics(pb.MetricsRequest(), timeout=T).agent
    assert 'pdbridge_agent_child_restarts_total{child="measured"} 1.0' in text
    assert 'pdbridge_agent_faults_active{kind="engine_kill"} 1.0' in text
    restored = _sample(text, "pdbridge_agent_faults_restored_total")
    api.ClearFault(pb.ClearFaultRequest(request_id=os.urandom(8).hex(), id=fault.id), timeout=T)
    text = api.Metrics(pb.MetricsRequest(), timeout=T).agent
    assert 'pdbridge_agent_faults_active{kind="engine_kill"} 0.0' in text
    assert _sample(text, "pdbridge_agent_faults_restored_total") == restored + 1
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="measured"), timeout=T)


def _sample(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def test_probe_rejects_bad_input(api: Any) -> None:
    with pytest.raises(grpc.RpcError) as err:
        api.Probe(pb.ProbeRequest(peer_site="remote", address="nowhere"), timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("address: expected host:port")
    with pytest.raises(grpc.RpcError) as err:
        api.Probe(
            pb.ProbeRequest(peer_site="remote", address="127.0.0.1:1", seconds=0.2), timeout=T
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith("address: peer 127.0.0.1:1 did not answer the probe")


@pytest.fixture
def peer_receiver(pki: Pki) -> Iterator[int]:
    """A real grpc_kv receiver (the peer site's kv-link) on its own loop in a thread, over
    mTLS, admitting the agent's identity ``dec-1``."""
    cert, key = pki.client("pre-1")
    tls = TLSConfig(ca_file=pki.ca, cert_file=cert, key_file=key, allowed_peers=["dec-1"])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ReceiverServer("127.0.0.1:0", tls=tls)
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    yield port
    asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_probe_measures_bandwidth_and_rtt_to_a_peer(api: Any, peer_receiver: int) -> None:
    request = pb.ProbeRequest(
        peer_site="remote", address=f"127.0.0.1:{peer_receiver}", seconds=0.5, max_bytes=8 << 20
    )
    result = api.Probe(request, timeout=T)
    assert result.peer_site == "remote"
    assert result.bandwidth_mbit_s > 0
    assert result.rtt_ms > 0
    assert 0 < result.bytes <= (8 << 20) + (1 << 20)
    # The namespace's TCP counters were read around it (loopback rarely retransmits).
    assert 0 <= result.tcp_retransmit_ratio < 0.5


def test_the_retransmitted_share_comes_from_the_kernels_tcp_counters(tmp_path) -> None:
    from agents.probe import retransmit_ratio, tcp_segments

    snmp = tmp_path / "snmp"
    snmp.write_text(
        "Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        "Tcp: RtoAlgorithm OutSegs RetransSegs InErrs\nTcp: 1 1000 10 0\n"
    )
    before = tcp_segments(snmp)
    assert before == (1000, 10)
    assert retransmit_ratio(before, (3000, 30)) == 0.01
    assert retransmit_ratio(before, before) == -1.0  # nothing sent: unknown, not 0
    assert retransmit_ratio(None, before) == -1.0
    assert tcp_segments(tmp_path / "absent") is None
    assert tcp_segments() is not None  # this machine's own


def test_kv_link_launch_then_probe_it_over_mtls(api: Any) -> None:
    request = pb.LaunchRequest(
        request_id=os.urandom(8).hex(),
        name="kv",
        kind="kv-link",
        settings=settings(host="127.0.0.1", allow_peers=["dec-1"], memory_budget_mb=64),
    )
    child = api.Launch(request, timeout=T).child
    assert child.state == "running"
    assert child.healthy
    probe = pb.ProbeRequest(
        peer_site="local", address=f"127.0.0.1:{child.port}", seconds=0.3, max_bytes=4 << 20
    )
    result = api.Probe(probe, timeout=T)
    assert result.bandwidth_mbit_s > 0
    assert result.rtt_ms > 0
    bad = pb.LaunchRequest(
        request_id=os.urandom(8).hex(), name="kv2", kind="kv-link", settings=settings(ttl_s=-1)
    )
    with pytest.raises(grpc.RpcError) as err:
        api.Launch(bad, timeout=T)
    assert err.value.details() == "settings.ttl_s: must be a positive number"
    api.Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="kv"), timeout=T)
