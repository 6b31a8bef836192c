"""Two "datacenters" on one machine: the test's own network namespace for the remote site,
joined to the root namespace (the local site) by a veth pair. Names carry a random suffix;
everything is torn down on exit. A link cut is ``ip link set <local end> down``."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.agents.engines.conftest import EngineProc
from tests.support import subprocess_env, unavailable


@dataclass
class RemoteSite:
    namespace: str
    local_if: str
    local_ip: str
    remote_ip: str

    def cut(self) -> None:
        _ip("link", "set", self.local_if, "down")

    def restore(self) -> None:
        _ip("link", "set", self.local_if, "up")


def _ip(*args: str, namespace: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def remote_site() -> Iterator[RemoteSite]:
    """A namespace reachable from the root namespace over a /30 veth link."""
    suffix = secrets.token_hex(3)
    ns, a, b = f"pdbgw-{suffix}", f"pga{suffix}", f"pgb{suffix}"
    octet = 100 + secrets.randbelow(150)
    third = secrets.randbelow(250)
    local_ip, remote_ip = f"10.{octet}.{third}.1", f"10.{octet}.{third}.2"
    try:
        _ip("netns", "add", ns)
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as error:
        unavailable(f"cannot create network namespaces: {error}")
    try:
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", b, "netns", ns)
        _ip("addr", "add", f"{local_ip}/30", "dev", a)
        _ip("link", "set", a, "up")
        _ip("addr", "add", f"{remote_ip}/30", "dev", b, namespace=ns)
        _ip("link", "set", b, "up", namespace=ns)
        _ip("link", "set", "lo", "up", namespace=ns)
        yield RemoteSite(ns, a, local_ip, remote_ip)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", a], capture_output=True, check=False)


def start_engine_in(
    site: RemoteSite, args: list[str], log: Path, timeout: float = 180
) -> EngineProc:
    """``pdbridge engine serve`` inside the site's namespace, bound to its address."""
    stderr = log.open("w")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", site.namespace, sys.executable, "-m", "pdbridge.cli", "engine",
         "serve", "--host", site.remote_ip, "--insecure", *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=subprocess_env(),
    )  # fmt: skip
    box: dict[str, str] = {}

    def read() -> None:
        assert proc.stdout is not None
        box["line"] = proc.stdout.readline()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not box.get("line"):
        proc.kill()
        raise RuntimeError(f"engine did not start: {log.read_text()[-2000:]}")
    port = json.loads(box["line"])["port"]
    return EngineProc(proc, f"http://{site.remote_ip}:{port}", json.loads(box["line"]), log)
