"""``pdbridge run`` smoke test on real processes: the testbed comes up, the deploy run's eight
steps succeed with the canary at 100 %, a request through the gateway is served on the remote
path with tokens, the printed ``curl`` line works, and SIGTERM leaves no process behind and
frees the ports. The same with ``--netns`` (root): the sites run in two namespaces, the WAN
probe sees the tbf-shaped veth, and shutdown removes the namespaces too."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sqlite3
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from pdbridge.procgroup import port_is_free, terminate_session
from tests.netns import require_netns
from tests.support import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = [
    "capacity_baseline", "wan_baseline", "remote_prefill", "local_decode",
    "kv_link", "gateway", "verification", "canary",
]  # fmt: skip
# The test process's own settings must not leak into the testbed (it has its own database).
FOREIGN = (
    "DJANGO_SETTINGS_MODULE",
    "DATABASE_URL",
    "CELERY_BROKER_URL",
    "REDIS_URL",
    "PDBRIDGE_ENV",
)


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark`` (the testbed and everything under it)."""
    found = []
    needle = f"PDBRIDGE_SMOKE_MARK={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def probe_evidence(ready: dict, db: sqlite3.Connection) -> dict:
    """Step 2's first probe, as recorded in the run's evidence."""
    return json.loads(
        db.execute(
            "SELECT evidence FROM runs_steprun WHERE run_id = ? AND name = 'wan_baseline'",
            (ready["deploy_run"],),
        ).fetchone()[0]
    )["probes"][0]


def test_make_run_reaches_full_share_serves_remote_and_shuts_down_clean(tmp_path):
    seen: dict[str, dict] = {}
    ready, _ = smoke(tmp_path, [], lambda ready, db: seen.update(probe=probe_evidence(ready, db)))

    assert ready["namespaces"] == []
    assert ready["gateway_url"].startswith("https://localhost:")
    # The WAN probe crossed the shaping proxy (200 Mbit/s by default), as the KV does: on
    # loopback alone it would measure hundreds of Mbit/s more than the link has.
    assert 0 < seen["probe"]["mbit_s"] <= 220, seen["probe"]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


@pytest.mark.netns
def test_make_run_netns_runs_the_sites_in_namespaces_and_removes_them(tmp_path):
    require_netns()
    seen: dict[str, object] = {}

    def while_up(ready: dict, db: sqlite3.Connection) -> None:
        seen["namespaces_while_up"] = set(ready["namespaces"]) <= namespaces()
        # Each agent runs inside its site's namespace, not in ours.
        pids = {
            site: subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                 check=True).stdout.split()
            for site, ns in zip(("local", "remote"), ready["namespaces"], strict=True)
        }  # fmt: skip
        seen["pids"] = pids
        seen["own_ns"] = {net_namespace(int(p)) for ps in pids.values() for p in ps} & {
            net_namespace(os.getpid())
        }
        seen["probe"] = probe_evidence(ready, db)

    ready, output = smoke(tmp_path, ["--netns", "--wan-mbit", "100"], while_up)

    local_ns, remote_ns = ready["namespaces"]
    assert local_ns.endswith(remote_ns.rsplit("-", 1)[1])  # one random suffix per run
    assert seen["namespaces_while_up"] is True
    assert all(seen["pids"].values()), seen["pids"]  # agents, engines, gateway... inside
    assert seen["own_ns"] == set()
    local_ip = ready["agents"]["local"].rsplit(":", 1)[0]
    remote_ip = ready["agents"]["remote"].rsplit(":", 1)[0]
    assert ready["gateway_url"].startswith(f"https://{local_ip}:")
    assert not local_ip.startswith("127.")
    assert not remote_ip.startswith("127.")
    # The WAN probe (remote agent -> the shaper in its own site -> the local kv-link) crossed
    # the tbf-shaped veth.
    probe = seen["probe"]
    assert probe["from"] == remote_ip
    assert probe["to"].startswith(f"{remote_ip}:")
    assert 0 < probe["mbit_s"] <= 110
    assert f"removed namespaces {local_ns}, {remote_ns}" in output
    assert not {local_ns, remote_ns} & namespaces()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    suffix = local_ns.rsplit("-", 1)[1]
    assert suffix not in links.stdout


def smoke(tmp_path: Path, args: list[str], while_up=None) -> tuple[dict, str]:
    """Run the testbed with ``args`` through the whole smoke check; ``while_up(ready, db)``
    looks at it while it is up. Returns the ready file and the output."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in subprocess_env(PDBRIDGE_SMOKE_MARK=mark).items() if k not in FOREIGN}
    ready_file = tmp_path / "ready.json"
    out = (tmp_path / "run.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "run", "--port", "0", "--gateway-port", "0",
         "--var-dir", str(tmp_path / "var"), "--ready-file", str(ready_file), *args],
        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while not ready_file.exists():
            assert proc.poll() is None, (tmp_path / "run.out").read_text()[-5000:]
            assert time.monotonic() < deadline, (tmp_path / "run.out").read_text()[-5000:]
            time.sleep(1)
        ready = json.loads(ready_file.read_text())
        output = (tmp_path / "run.out").read_text()

        for index, name in enumerate(STEPS, start=1):
            assert f"step {index}/8 {name}: succeeded" in output
        db = sqlite3.connect(Path(ready["var_dir"]) / "pdbridge.sqlite3")
        steps = db.execute(
            'SELECT name, state FROM runs_steprun WHERE run_id = ? ORDER BY "index"',
            (ready["deploy_run"],),
        ).fetchall()
        assert steps == [(name, "succeeded") for name in STEPS]
        state, share = db.execute(
            "SELECT state, remote_share_percent FROM deployments_deployment WHERE id = ?",
            (ready["deployment_id"],),
        ).fetchone()
        if while_up is not None:
            while_up(ready, db)
        assert (state, share) == ("active", 100)

        # Both agents report mTLS and the hash of the weights their engine serves, equal to
        # the catalog's: the readiness checklist's weights and certificates items have data.
        def reports() -> list[tuple[str, dict, list]]:
            rows = db.execute(
                "SELECT hostname, reported_tls, reported_weights FROM inventory_node"
            ).fetchall()
            return [(h, json.loads(t or "null"), json.loads(w or "null")) for h, t, w in rows]

        (catalog_sha,) = db.execute(
            "SELECT m.weights_sha256 FROM catalog_modelspec m JOIN deployments_deployment d "
            "ON d.model_id = m.id WHERE d.id = ?",
            (ready["deployment_id"],),
        ).fetchone()
        deadline = time.monotonic() + 60
        while not all(w and {e["state"] for e in w} == {"ok"} for _, _, w in reports()):
            assert time.monotonic() < deadline, reports()
            time.sleep(1)
        final = reports()
        db.close()
        assert len(catalog_sha) == 64
        assert len(final) == 2
        for _, tls, weights in final:
            assert tls["mtls"] is True
            assert tls["not_after"] > time.strftime("%Y-%m-%d")
            assert [e["sha256"] for e in weights if e["child"]] == [catalog_sha]

        # A fresh prompt over the threshold goes the remote way and returns tokens.
        context = ssl.create_default_context(cafile=ready["ca"])
        prompt = "A fresh prompt for the smoke test, long enough to be prefilled remotely. " * 6
        body = {"model": ready["served_model"], "prompt": prompt, "max_tokens": 8}
        request = urllib.request.Request(  # noqa: S310 - the testbed's gateway
            f"{ready['gateway_url']}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60, context=context) as response:  # noqa: S310
            answer = json.loads(response.read())
            assert response.headers["x-pdbridge-path"] == "remote"
        # Random weights may sample the end-of-text token early: at least one token, counted.
        assert 1 <= answer["usage"]["completion_tokens"] <= 8
        assert len(answer["choices"][0]["token_ids"]) == answer["usage"]["completion_tokens"]

        # The printed curl line works as printed (first use of its prompt: remote).
        [line] = [x for x in output.splitlines() if x.strip().startswith("try:")]
        if shutil.which("curl"):
            argv = shlex.split(line.split("try:", 1)[1])
            curl = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            assert curl.returncode == 0, curl.stderr
            assert "200 OK" in curl.stdout.splitlines()[0]
            assert "x-pdbridge-path: remote" in curl.stdout
            printed = json.loads(curl.stdout.replace("\r\n", "\n").split("\n\n", 1)[1])
            assert 1 <= printed["usage"]["completion_tokens"] <= 16
        assert marked_processes(mark), "the testbed's processes carry the mark"
    finally:
        stopped_in_time = terminate_session(proc)
        out.close()

    output = (tmp_path / "run.out").read_text()
    assert stopped_in_time
    assert proc.returncode == 0, output[-3000:]
    assert "stopped" in output
    assert "killed leftover process" not in output
    assert marked_processes(mark) == []
    console_port = int(ready["console_url"].rsplit(":", 1)[1])
    gateway_port = int(ready["gateway_url"].rsplit(":", 1)[1])
    assert port_is_free(console_port)
    if not ready["namespaces"]:  # with --netns the gateway's port was in a namespace
        assert port_is_free(gateway_port)
    return ready, output
