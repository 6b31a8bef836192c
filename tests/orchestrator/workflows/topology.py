"""A two-site testbed for the deployment and canary workflows, all real processes, the two
sites in network namespaces (:mod:`pdbridge.netns`, as ``pdbridge run --netns``): the console
(gunicorn on the test database, in the root namespace, listening on loopback and on the
console address the sites reach: agents heartbeat, the gateway polls its config), two node
agents with mTLS, each in its site's namespace (site ``local``: decode, kv-link, gateway; site
``remote``: prefill), the WAN as the tbf-shaped veth between the sites with the remote agent's
userspace fault proxy in the KV path (prefill engines dial it; latency and faults come from
it), and the inventory / catalog / deployment rows that describe them. Celery workers, Redis
and the test's clients stay in the root namespace and reach the sites at their addresses.

Engines, kv-link and gateway are *not* started here: the deployment workflow launches them
through the agents. Built once per module (engine weights, namespaces, agents, console); see
``test_deploy_flow.py``. Needs root and iproute2 (:func:`sites_up`: a skip without them, a
failure under CI=true).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.engines.verify import make_prompt
from grpc_kv.api import create_ca, create_node_cert
from pdbridge import netns
from pdbridge.testbed_models import MODELS
from tests.agents.conftest import AgentProc, free_port, start_agent
from tests.support import deadline_in, subprocess_env, unavailable

MODEL = "qwen3-next"
SERVED = "tiny"
# What the catalog says about the model (the capacity baseline reads it): the testbed's own.
ARCH = MODELS[MODEL].architecture
# The reference engine's own command prefix (what an agent runs without engine_executables).
PDBRIDGE_CLI = [sys.executable, "-m", "pdbridge.cli"]


@dataclass
class Pki:
    ca: Path
    node_cert: Path
    node_key: Path
    controller_cert: Path
    controller_key: Path

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


#: The WAN veth's rate (tbf): far above what the tiny model's KV needs, but a shaped link.
WAN_MBIT = 1000.0


@contextmanager
def sites_up() -> Iterator[netns.NamespaceSites]:
    """The two namespace sites (skip without root and iproute2; a failure under CI=true).
    Stop every process inside before leaving."""
    try:
        netns.check_available()
    except netns.NetnsError as exc:
        unavailable(str(exc))
    with netns.namespace_sites(rate_mbit=WAN_MBIT) as sites:
        yield sites


#: The identity (common name) of the node certificate both sites share.
NODE_IDENTITY = "localhost"


def make_pki(directory: Path, addresses: Sequence[str] = ()) -> Pki:
    """CA, the node certificate ``localhost`` (SANs add ``addresses``: every server is dialled
    by its site's IP; and the loopback names, asked for as the testbed does) and the
    controller's ``orchestrator``."""
    ca = create_ca(directory / "ca")
    node = create_node_cert(
        ca, directory / "nodes", NODE_IDENTITY, sans=list(addresses), loopback=True
    )
    controller = create_node_cert(ca, directory / "nodes", "orchestrator")
    return Pki(ca.ca_file, node.cert_file, node.key_file, controller.cert_file, controller.key_file)


_taken: set[int] = set()


def pinned_port() -> int:
    """A free port below the kernel's ephemeral range, probed: a port pinned in a deployment's
    settings must not collide with the source port of some long-lived outgoing connection."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = secrets.choice(range(max(1024, low - 12000), low))
        if port in _taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass
class Ports:
    decode: int = field(default_factory=pinned_port)
    prefill: int = field(default_factory=pinned_port)
    kv_receiver: int = field(default_factory=pinned_port)  # decode engine's embedded receiver
    kv_wan: int = field(default_factory=pinned_port)  # the remote agent's fault proxy in front
    kv_link: int = field(default_factory=pinned_port)
    gateway: int = field(default_factory=pinned_port)


def build_models(models_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "engine", "build", MODEL, "--models-dir", str(models_dir)],
        check=True, env=subprocess_env(), capture_output=True, timeout=300,
    )  # fmt: skip


class Console:
    """The console under gunicorn with TLS (agents and gateways require https) on the test
    database, on loopback (``url``) and on the address the sites reach (``site_url``)."""

    def __init__(self, database_url: str, log: Path, pki: Pki, site_host: str) -> None:
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.site_url = f"https://{site_host}:{self.port}"
        env = subprocess_env(
            DJANGO_SETTINGS_MODULE="console.settings",
            PDBRIDGE_ENV="test",
            DATABASE_URL=database_url,
            ALLOWED_HOSTS=f"localhost,127.0.0.1,testserver,{site_host}",
        )
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "console.wsgi", "--bind", f"127.0.0.1:{self.port}",
                 "--bind", f"{site_host}:{self.port}", "--workers", "1", "--threads", "8",
                 "--certfile", str(pki.node_cert), "--keyfile", str(pki.node_key)],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = deadline_in(60)
        while True:
            try:
                urllib.request.urlopen(  # noqa: S310 (loopback)
                    f"{self.url}/api/", timeout=2, context=pki.ssl_context()
                )
                return
            except urllib.error.HTTPError:
                return  # it answers (401/404 are answers)
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"console did not start: {log.read_text()[-3000:]}"
                    ) from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def agent_config(
    tmp: Path,
    pki: Pki,
    site: str,
    console_url: str,
    token_file: Path,
    proxies: dict[str, Any],
    host: str = "127.0.0.1",
) -> dict[str, Any]:
    """A site's agent listening on ``host`` (its site's address)."""
    return {
        "node": {"name": host, "site": site},
        "listen": f"{host}:0",
        "state_dir": str(tmp / "state"),
        "metrics_listen": f"{host}:0",
        "tls": {
            "ca": str(pki.ca),
            "cert": str(pki.node_cert),
            "key": str(pki.node_key),
            "allowed_identities": ["orchestrator"],
        },
        "console": {
            "url": console_url,
            "token_file": str(token_file),
            "ca": str(pki.ca),
            "heartbeat_interval_s": 2,
        },
        "supervision": {
            "readiness_timeout_s": 180,
            "health_interval_s": 1,
            "health_failures": 5,
            "stop_grace_s": 3,
        },
        "faults": {"mechanism": "proxy", "proxies": proxies},
    }


def start_site_agent(
    tmp: Path, config: dict[str, Any], sites: netns.NamespaceSites, site: str
) -> AgentProc:
    """The agent inside ``site``'s namespace (what it launches runs there too)."""
    host = sites.site(site).address
    return start_agent(tmp, config, timeout=60, wrap=lambda a: sites.wrap(site, a), host=host)


class Traffic:
    """Clients of the gateway: long prompts (eligible for remote prefill) in a loop from a
    few threads until stopped. Counts answers by status and path."""

    def __init__(self, url: str, context: ssl.SSLContext, threads: int = 2) -> None:
        self.url, self.context = url, context
        self.stopped = threading.Event()
        self.results: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)
        ]

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(60)

    def _loop(self, index: int) -> None:
        import json

        n = 0
        while not self.stopped.is_set():
            n += 1
            body = json.dumps(
                {"model": SERVED, "prompt": make_prompt(300, seed=index * 1000 + n), "max_tokens": 4,
                 "temperature": 0}
            ).encode()  # fmt: skip
            request = urllib.request.Request(  # noqa: S310 (the test's own gateway)
                f"{self.url}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60, context=self.context) as r:  # noqa: S310
                    r.read()
                    outcome = (r.status, r.headers.get("x-pdbridge-path", ""))
            except urllib.error.HTTPError as exc:
                outcome = (exc.code, exc.headers.get("x-pdbridge-path", ""))
            except OSError:
                outcome = (0, "")  # not up yet (or going down): try again shortly
                time.sleep(0.5)
            with self.lock:
                self.results.append(outcome)

    def count(self, status: int = 200) -> int:
        with self.lock:
            return sum(1 for s, _ in self.results if s == status)


def controller_env(pki: Pki) -> dict[str, str]:
    return {
        "PDBRIDGE_CONTROLLER_TLS_CA": str(pki.ca),
        "PDBRIDGE_CONTROLLER_TLS_CERT": str(pki.controller_cert),
        "PDBRIDGE_CONTROLLER_TLS_KEY": str(pki.controller_key),
    }


def set_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the module, restoring them afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class RedisServer:
    """A Redis server of the test's own (never the machine's shared one), restartable on the
    same port; no persistence, so a restart loses every queued message, as a crash would."""

    def __init__(self, tmp: Path) -> None:
        if shutil.which("redis-server") is None:
            unavailable("redis-server is not installed (the test restarts a Redis of its own)")
        self.port, self.tmp = pinned_port(), tmp
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.tmp)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = deadline_in(20)
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


def start_beat(tmp: Path, broker_url: str, database_url: str) -> subprocess.Popen[bytes]:
    """``celery beat`` with the database scheduler (it sends resume_stalled every 15 s)."""
    env = subprocess_env(
        DJANGO_SETTINGS_MODULE="console.settings",
        PDBRIDGE_ENV="test",
        DATABASE_URL=database_url,
        CELERY_BROKER_URL=broker_url,
        PDBRIDGE_VAR_DIR=str(tmp / "var"),
    )
    with (tmp / "beat.log").open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "orchestrator.celery", "beat", "-l", "INFO",
             "-s", str(tmp / "beat-schedule")],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
