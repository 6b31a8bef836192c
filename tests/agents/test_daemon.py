"""The agent as a process: kill -9 leaves no child behind, SIGTERM stops children gracefully,
config errors name the key, heartbeats back off while the console fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from agents.proto.api import pb
from tests.agents.conftest import (
    AgentProc,
    FakeConsole,
    agent_config,
    command_pids,
    free_port,
    pid_alive,
    stub,
)
from tests.agents.test_grpc_api import T, settings
from tests.support import subprocess_env, wait_for


def _launch_family(agent: AgentProc, tmp_path: Path) -> tuple[int, int, int]:
    """A child whose command starts a grandchild; returns (keeper, command, grandchild) pids."""
    pidfile = tmp_path / "grandchild.pid"
    request = pb.LaunchRequest(
        request_id="fam-1",
        name="fam",
        kind="decode-engine",
        engine="family",
        settings=settings(pidfile=str(pidfile)),
    )
    child = stub(agent, None).Launch(request, timeout=T).child
    (command,) = command_pids(child.pid)
    grandchild = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 5))
    assert pid_alive(grandchild)
    return child.pid, command, grandchild


def test_kill_9_of_agent_leaves_no_child(
    agent_factory: Callable[..., AgentProc], tmp_path: Path
) -> None:
    agent = agent_factory(agent_config(tmp_path, None))
    pids = _launch_family(agent, tmp_path)
    agent.kill9()
    wait_for(lambda: not any(pid_alive(p) for p in pids), 5)


def test_restarted_agent_reaps_a_group_its_keeper_could_not(
    agent_factory: Callable[..., AgentProc], tmp_path: Path
) -> None:
    """Belt and braces: even if the keeper itself is SIGKILLed together with the agent, the
    next agent kills what is left of the recorded process groups before serving."""
    config = agent_config(tmp_path, None)
    agent = agent_factory(config)
    keeper, _, grandchild = _launch_family(agent, tmp_path)
    os.kill(agent.process.pid, signal.SIGSTOP)  # the agent cannot react to what follows
    os.kill(keeper, signal.SIGKILL)
    wait_for(lambda: not pid_alive(keeper), 5)
    agent.kill9()
    assert pid_alive(grandchild)  # no keeper left to clean up: an orphan, for now
    agent_factory(config, subdir="second")
    wait_for(lambda: not pid_alive(grandchild), 5)


def test_sigterm_stops_children_gracefully(
    agent_factory: Callable[..., AgentProc], tmp_path: Path
) -> None:
    agent = agent_factory(agent_config(tmp_path, None))
    child = (
        stub(agent, None)
        .Launch(
            pb.LaunchRequest(request_id="g-1", name="g", kind="gateway", engine="plain"), timeout=T
        )
        .child
    )
    assert child.state == "running"
    assert agent.terminate() == 0
    assert not pid_alive(child.pid)
    assert not (agent.state_dir / "agent.json").exists()


def test_config_error_names_the_key(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(
        "node: {name: n1, site: s1}\ninsecure: true\nsupervision: {crash_loop_limit: zero}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "agent", "--config", str(config)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "config error: supervision.crash_loop_limit: expected a number" in result.stderr


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (
            "metrics_listen: 127.0.0.1:{busy}\n",
            1,
            "cannot start: metrics_listen: cannot listen on 127.0.0.1:{busy}:",
        ),
        (
            "faults: {{proxies: {{remote: {{listen: '127.0.0.1:{busy}', upstream: '127.0.0.1:9'}}}}}}\n",
            1,
            "cannot start: faults.proxies.remote.listen: cannot listen on 127.0.0.1:{busy}:",
        ),
        (
            "listen: 127.0.0.1:{busy}\n",
            1,
            "cannot start: listen: cannot listen on 127.0.0.1:{busy}:",
        ),
        ("state_dir: {tmp}/agent.yaml/state\n", 1, "cannot start: state_dir: cannot use"),
        (
            "console: {{url: 'http://127.0.0.1:9', token_file: '{tmp}/no-token'}}\n",
            2,
            "config error: console.token_file: [Errno 2] No such file or directory",
        ),
    ],
    ids=[
        "metrics-port-taken",
        "proxy-port-taken",
        "listen-port-taken",
        "state-dir-unusable",
        "token-file-missing",
    ],
)
def test_startup_failures_name_the_key_without_a_traceback(
    tmp_path: Path, extra: str, code: int, message: str
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        values = {"busy": busy.getsockname()[1], "tmp": tmp_path}
        config = tmp_path / "agent.yaml"
        config.write_text(
            "node: {name: n1, site: s1}\ninsecure: true\nlisten: 127.0.0.1:0\n"
            f"state_dir: {tmp_path}/state\n" + extra.format(**values)
        )
        result = subprocess.run(
            [sys.executable, "-m", "pdbridge.cli", "agent", "--config", str(config)],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=60,
            check=False,
        )
    assert result.returncode == code, result.stderr
    assert f"pdbridge agent: {message.format(**values)}" in result.stderr
    assert "Traceback" not in result.stderr


def test_heartbeats_back_off_while_console_fails_and_children_keep_running(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, console: FakeConsole
) -> None:
    console.heartbeat_status = 500
    console.heartbeats.clear()
    try:
        config = agent_config(
            tmp_path,
            None,
            console={
                "url": console.url,
                "token": "t",
                "heartbeat_interval_s": 0.1,
                "backoff_max_s": 0.8,
            },
        )
        agent = agent_factory(config)
        child = (
            stub(agent, None)
            .Launch(
                pb.LaunchRequest(request_id="hb-1", name="hb", kind="kv-link", engine="plain"),
                timeout=T,
            )
            .child
        )
        wait_for(lambda: len(console.heartbeats) >= 5, 15)
        metrics = _scrape(agent)
        assert _value(metrics, "pdbridge_agent_heartbeat_failures_total") >= 4
        assert (
            stub(agent, None).Status(pb.StatusRequest(name="hb"), timeout=T).children[0].pid
            == child.pid
        )
        console.heartbeat_status = 200
        count = len(console.heartbeats)
        wait_for(lambda: len(console.heartbeats) >= count + 3, 10)  # recovers: back to interval_s
    finally:
        console.heartbeat_status = 200


def test_heartbeats_back_off_exponentially_while_the_console_is_unreachable(
    agent_factory: Callable[..., AgentProc], tmp_path: Path
) -> None:
    config = agent_config(
        tmp_path,
        None,
        console={
            "url": f"http://127.0.0.1:{free_port()}",  # nothing listens: connection refused
            "token": "t",
            "heartbeat_interval_s": 0.1,
            "backoff_max_s": 0.8,
        },
    )
    agent = agent_factory(config)
    request = pb.LaunchRequest(request_id="hb-2", name="hb", kind="decode-engine", engine="plain")
    child = stub(agent, None).Launch(request, timeout=T).child

    def retries() -> list[float]:
        return [
            event["retry_in_s"]
            for line in agent.log_path.read_text().splitlines()
            if line[:1] == "{" and (event := json.loads(line))["event"] == "agent.heartbeat_failed"
        ]

    delays = wait_for(lambda: len(retries()) >= 5 and retries(), 15)
    assert delays[:5] == [0.2, 0.4, 0.8, 0.8, 0.8]  # doubling from the interval, capped
    assert _value(_scrape(agent), "pdbridge_agent_heartbeat_failures_total") >= 5
    now = stub(agent, None).Status(pb.StatusRequest(name="hb"), timeout=T).children[0]
    assert (now.pid, now.state, now.healthy) == (child.pid, "running", True)


def _scrape(agent: AgentProc) -> str:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5
    ) as resp:
        text: str = resp.read().decode()
        return text


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in metrics")


def test_call_without_deadline_gets_the_default_and_leaves_nothing_running(
    agent_factory: Callable[..., AgentProc], tmp_path: Path
) -> None:
    # The engine never becomes ready within readiness_timeout_s: the launch, which goes on
    # after its caller's deadline, ends by stopping it.
    config = agent_config(
        tmp_path, None, default_deadline_s=1.5, supervision={"readiness_timeout_s": 3}
    )
    agent = agent_factory(config)
    request = pb.LaunchRequest(
        request_id="slow-1", name="slow", kind="decode-engine", engine="slow"
    )
    with pytest.raises(grpc.RpcError) as err:
        stub(agent, None).Launch(request)  # no client deadline: the agent's default applies
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.details() == (
        "Launch did not finish within its deadline; "
        "it goes on: retry with the same request_id for its outcome"
    )
    assert list(stub(agent, None).Status(pb.StatusRequest(), timeout=T).children) == []
    events = [
        json.loads(line) for line in agent.log_path.read_text().splitlines() if line.startswith("{")
    ]
    spawned = [e["pid"] for e in events if e["event"] == "agent.child_spawned"]
    assert len(spawned) == 1
    wait_for(lambda: not pid_alive(spawned[0]), 15)
    assert list(stub(agent, None).Status(pb.StatusRequest(), timeout=T).children) == []


def _ctl(agent: AgentProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pdbridge.cli",
            "agent",
            "ctl",
            "--insecure",
            "--address",
            agent.address,
            *args,
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
        check=False,
    )


def test_operator_ctl(agent_factory: Callable[..., AgentProc], tmp_path: Path) -> None:
    agent = agent_factory(agent_config(tmp_path, None))
    launched = _ctl(agent, "launch", "decode-engine", "--engine", "plain", "--child-name", "d")
    assert launched.returncode == 0, launched.stderr
    assert json.loads(launched.stdout)["child"]["state"] == "running"
    status = json.loads(_ctl(agent, "status").stdout)
    assert [c["name"] for c in status["children"]] == ["d"]
    assert b"healthserver pid=" in _ctl(agent, "logs", "d").stdout.encode()
    bad = _ctl(agent, "fault", "inject", "engine_kill", "d", "--for", "0")
    assert bad.returncode == 1
    assert (
        bad.stderr.strip()
        == "INVALID_ARGUMENT: duration_s: a fault needs an expiry: duration_s > 0"
    )
    assert (
        _ctl(agent, "launch", "gateway", "--settings", "[1]")
        .stderr.strip()
        .endswith("--settings: a JSON object is required")
    )
    assert _ctl(agent, "stop", "d").returncode == 0


def test_process_limits_apply_to_children(
    agent_factory: Callable[..., AgentProc], tmp_path: Path
) -> None:
    agent = agent_factory(agent_config(tmp_path, None, supervision={"limit_nofile": 321}))
    child = (
        stub(agent, None)
        .Launch(
            pb.LaunchRequest(request_id="lim-1", name="lim", kind="decode-engine", engine="plain"),
            timeout=T,
        )
        .child
    )
    (command,) = command_pids(child.pid)
    limits = Path(f"/proc/{command}/limits").read_text()
    assert any(
        line.startswith("Max open files") and line.split()[3:5] == ["321", "321"]
        for line in limits.splitlines()
    )


def test_launches_of_different_children_run_side_by_side_up_to_max_children(
    agent_factory: Callable[..., AgentProc], tmp_path: Path
) -> None:
    agent = agent_factory(agent_config(tmp_path, None, supervision={"max_children": 2}))
    api = stub(agent, None)

    def launch(name: str) -> Any:
        request = pb.LaunchRequest(
            request_id=f"par-{name}", name=name, kind="decode-engine", engine="unhurried"
        )
        return api.Launch(request, timeout=T)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(launch, ["a", "b"]))
    assert [r.child.state for r in results] == ["running", "running"]
    events = [
        json.loads(line) for line in agent.log_path.read_text().splitlines() if line.startswith("{")
    ]
    order = [
        e["event"]
        for e in events
        if e["event"] in {"agent.child_spawned", "agent.child_state"}
        and e.get("to", "running") == "running"
    ]
    # Both children were spawned before either became healthy: no launch waited for the other.
    assert order[:2] == ["agent.child_spawned", "agent.child_spawned"]
    with pytest.raises(grpc.RpcError) as err:
        launch("c")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "name: supervision.max_children (2) reached"
