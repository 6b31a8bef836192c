"""A two-site testbed for drills: the remote site is a network namespace (tests.agents.gateway.
netns) with its own agent supervising a reference prefill engine; the local site (root
namespace) has an agent whose WAN interface is the veth towards the remote site, a reference
decode engine with an embedded grpc_kv receiver, and a gateway (in a thread of the test
process) routing long prompts to the remote engine. Everything is real and torn down on exit.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from agents.client import AgentClient
from agents.gateway.config import GatewaySettings
from grpc_kv.tls import TLSConfig
from tests.agents.conftest import AgentProc, agent_config, start_agent
from tests.agents.engines.client import free_port
from tests.agents.engines.conftest import EngineProc, start_engine
from tests.agents.gateway.harness import serving
from tests.agents.gateway.netns import RemoteSite, remote_site
from tests.agents.gateway.snapshots import snapshot
from tests.agents.gateway.test_engines import SETTINGS
from tests.support import deadline_in, subprocess_env

MODEL = "qwen3-next"
PREFILL_CHILD = "drill-prefill"
GATEWAY_SETTINGS = replace(SETTINGS, prefill_timeout_s=1.5, connect_timeout_s=0.5)
SUPERVISION = {"readiness_timeout_s": 150, "backoff_initial_s": 0.2, "backoff_max_s": 1}


@dataclass
class TwoSites:
    site: RemoteSite
    local_agent: AgentProc
    remote_agent_address: str
    decode: EngineProc
    gateway_url: str
    models_dir: Path

    def link_up(self) -> bool:
        out = subprocess.run(
            ["ip", "-j", "link", "show", self.site.local_if],
            capture_output=True, text=True, check=True, timeout=10,
        )  # fmt: skip
        return "UP" in json.loads(out.stdout)[0]["flags"]

    def remote_child(self) -> dict[str, Any]:
        async def go() -> Any:
            async with AgentClient(self.remote_agent_address, TLSConfig(insecure=True)) as agent:
                return await agent.status()

        status = asyncio.run(go())
        child = next(c for c in status.children if c.name == PREFILL_CHILD)
        return {"state": child.state, "pid": child.pid, "restarts": child.restarts}


def build_models(models_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "engine", "build", MODEL, "--models-dir", str(models_dir)],
        check=True, env=subprocess_env(), capture_output=True, timeout=300,
    )  # fmt: skip


def _start_agent_in(site: RemoteSite, tmp: Path, config: dict[str, Any]) -> tuple[Any, str]:
    """``pdbridge agent`` inside the site's namespace; returns (process, control address)."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    info = Path(config["state_dir"]) / "agent.json"
    log = (tmp / "agent.log").open("wb")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", site.namespace, sys.executable, "-m", "pdbridge.cli", "agent",
         "--config", str(path)],
        stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(),
    )  # fmt: skip
    deadline = deadline_in(60)
    while not info.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"remote agent did not start: {(tmp / 'agent.log').read_text()}")
        time.sleep(0.1)
    return proc, f"{site.remote_ip}:{json.loads(info.read_text())['port']}"


def _launch_prefill(address: str, site: RemoteSite, models_dir: Path) -> None:
    settings = {
        "model": MODEL,
        "served_model_name": "tiny",
        "host": site.remote_ip,
        "chunked_prefill_tokens": 64,
        "kv_connector_extra_config": {"models_dir": str(models_dir), "threads": 1},
        "extra_args": ["--insecure", "--kv-insecure", "--max-num-seqs", "16"],
    }

    async def go() -> Any:
        async with AgentClient(address, TLSConfig(insecure=True)) as agent:
            return await agent.launch("prefill-engine", "reference", settings, name=PREFILL_CHILD)

    answer = asyncio.run(go())
    if answer.child.state != "running":
        raise RuntimeError(f"prefill engine not running: {answer}")


@contextmanager
def _gateway_thread(data: dict[str, Any], settings: GatewaySettings) -> Iterator[str]:
    box: dict[str, Any] = {}
    ready, stop = threading.Event(), threading.Event()

    async def main() -> None:
        try:
            async with serving(data, settings) as (_, _client, url):
                box["url"] = url
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.1)
        except BaseException as exc:
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    ready.wait(60)
    if "url" not in box:
        raise RuntimeError(f"gateway did not start: {box.get('error')!r}")
    try:
        yield box["url"]
    finally:
        stop.set()
        thread.join(30)


@contextmanager
def two_sites(tmp: Path, models_dir: Path, *, fault_proxy: bool = False) -> Iterator[TwoSites]:
    """The whole two-site system (see the module docstring). ``fault_proxy``: laid out as
    ``pdbridge run``'s testbed instead -- the KV path crosses the remote agent's fault proxy
    (``faults.proxies.local``) and the local agent has nothing to cut the link with, so a
    link cut must be injected at the remote agent."""
    with remote_site() as site:
        kv_listen = f"{site.local_ip}:{free_port() if fault_proxy else 0}"
        remote_faults: dict[str, Any] = {}
        local_faults: dict[str, Any] = {"wan_interface": site.local_if}
        if fault_proxy:
            proxy = {"listen": f"{site.remote_ip}:{free_port()}", "upstream": kv_listen}
            remote_faults = {"mechanism": "proxy", "proxies": {"local": proxy}}
            local_faults = {"mechanism": "proxy"}
        remote_cfg = agent_config(
            tmp / "remote", None, node={"name": "pre-1", "site": "remote"},
            listen=f"{site.remote_ip}:0", supervision=SUPERVISION, faults=remote_faults,
        )  # fmt: skip
        remote_proc, remote_address = _start_agent_in(site, tmp / "remote", remote_cfg)
        local_agent = decode = None
        try:
            local_agent = start_agent(
                tmp / "local", agent_config(tmp / "local", None, faults=local_faults)
            )
            decode = start_engine(
                ["--model", f"tiny={MODEL}", "--models-dir", str(models_dir),
                 "--chunked-prefill-tokens", "64", "--threads", "1", "--max-num-seqs", "16",
                 "--role", "decode", "--host", site.local_ip, "--insecure",
                 "--kv-listen", kv_listen, "--kv-insecure"],
                tmp / "decode.log", timeout=180,
            )  # fmt: skip
            decode.url = f"http://{site.local_ip}:{decode.ready['port']}"
            _launch_prefill(remote_address, site, models_dir)
            prefill_port = _child_port(remote_address)
            data = snapshot(
                decode_urls=(decode.url,),
                prefill_sites={"remote": (f"http://{site.remote_ip}:{prefill_port}",)},
                remote_prefill_threshold_tokens=64,
            )
            data["model"]["engine_settings"] = {}
            # The prefill engine pushes KV to the decode engine's receiver, through the remote
            # agent's fault proxy when there is one.
            data["pools"]["decode"]["nodes"][0]["kv_address"] = (
                remote_faults["proxies"]["local"]["listen"]
                if fault_proxy
                else decode.ready["kv_listen"]
            )
            data["kv_transfer"]["timeout_ms"] = 3000
            with _gateway_thread(data, GATEWAY_SETTINGS) as url:
                yield TwoSites(site, local_agent, remote_address, decode, url, models_dir)
        finally:
            if decode is not None:
                decode.stop()
            if local_agent is not None:
                local_agent.terminate()
            remote_proc.terminate()
            try:
                remote_proc.wait(30)
            except subprocess.TimeoutExpired:
                remote_proc.kill()


def _child_port(address: str) -> int:
    async def go() -> Any:
        async with AgentClient(address, TLSConfig(insecure=True)) as agent:
            return await agent.status(PREFILL_CHILD)

    status = asyncio.run(go())
    return int(next(c.port for c in status.children if c.name == PREFILL_CHILD))


def two_site_deployment(local_agent: str, remote_agent: str) -> Any:
    """Console rows for the two sites: a deployment whose decode pool is ``dec-1`` at ``local``
    and whose prefill pool is ``pre-1`` at ``remote``, with the given agent addresses."""
    from console.deployments.services import pool_create
    from tests.console.factories import ModelSpecFactory, NodeFactory, SiteFactory, make_deployment

    local = SiteFactory(name="local", role="decode")
    remote = SiteFactory(name="remote", role="prefill")
    dec = NodeFactory(site=local, hostname="dec-1", agent_address=local_agent)
    pre = NodeFactory(site=remote, hostname="pre-1", agent_address=remote_agent)
    deployment = make_deployment(name="drilled", model=ModelSpecFactory(name="tiny"))
    pool_create(actor=None, deployment=deployment, role="decode", site=local, nodes=[dec])
    pool_create(actor=None, deployment=deployment, role="prefill", site=remote, nodes=[pre])
    return deployment
