"""``pdbridge gateway`` as a real child process."""

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.agents.gateway.snapshots import snapshot
from tests.support import subprocess_env


def test_serves_a_static_config_file(tmp_path):
    config = tmp_path / "snapshot.json"
    config.write_text(json.dumps(snapshot(version=7)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "gateway", "--config", str(config),
         "--insecure", "--port", "0", "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("pdbridge gateway listening on 127.0.0.1:"), proc.stderr.read()
        port = int(line.strip().rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            health = json.loads(r.read())
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)

    # No probe has judged the snapshot's (unreachable) engines yet: both pools count whole.
    assert health == {
        "status": "ok",
        "config_version": 7,
        "pools": [
            {
                "role": "decode",
                "site": "local",
                "healthy": 1,
                "total": 1,
                "drained": 0,
                "status": "ok",
            },
            {
                "role": "prefill",
                "site": "remote",
                "healthy": 1,
                "total": 1,
                "drained": 0,
                "status": "ok",
            },
        ],
    }
    assert proc.returncode == 0
    events = [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]
    assert events[0] == "gateway.listening"
    assert events[-1] == "gateway.stopping"


def _run(*args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "gateway", *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=60, check=False, cwd=tmp_path,
    )  # fmt: skip


def test_refuses_plaintext_without_insecure(tmp_path):
    config = tmp_path / "snapshot.json"
    config.write_text(json.dumps(snapshot()))

    result = _run("--config", str(config), tmp_path=tmp_path)

    assert result.returncode == 2
    assert "--tls-cert/--tls-key required (or --insecure)" in result.stderr


def test_refuses_http_console_without_insecure(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")

    result = _run("--deployment", "1", "--console", "http://console", "--tls-cert", str(cert),
                  "--tls-key", str(cert), tmp_path=tmp_path)  # fmt: skip

    assert result.returncode == 2
    assert "must be https://" in result.stderr


def test_invalid_config_file_names_the_field(tmp_path):
    data = snapshot()
    data["routing"]["remote_share_percent"] = "lots"
    config = tmp_path / "snapshot.json"
    config.write_text(json.dumps(data))

    started = time.monotonic()
    result = _run("--config", str(config), "--insecure", "--port", "0", tmp_path=tmp_path)

    assert result.returncode == 2
    assert "routing.remote_share_percent: must be a number" in result.stderr
    assert time.monotonic() - started < 60


def test_unknown_setting_is_refused(tmp_path):
    settings = tmp_path / "gateway.yaml"
    settings.write_text("fallback_rate: 3\n")

    result = _run(
        "--config", "x.json", "--settings", str(settings), "--insecure", tmp_path=tmp_path
    )

    assert result.returncode == 2
    assert "settings.fallback_rate: unknown setting" in result.stderr


def test_tls_everywhere_without_insecure(tmp_path):
    """Gateway served over TLS; console and engines over mTLS (they require the gateway's
    client certificate, signed by the test CA)."""
    import asyncio
    import ssl

    import aiohttp

    from grpc_kv.certs import create_ca, create_node_cert
    from tests.agents.gateway.console_double import ConsoleDouble
    from tests.agents.gateway.engine_double import EngineDouble, KvStore

    ca = create_ca(tmp_path / "ca")
    server = create_node_cert(ca, tmp_path / "certs", "services", loopback=True)
    gateway_cert = create_node_cert(ca, tmp_path / "certs", "gateway", loopback=True)

    def mtls_server() -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca.ca_file))
        context.load_cert_chain(server.cert_file, server.key_file)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    async def scenario():
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start(mtls_server())
        prefill = await EngineDouble("prefill", kv).start(mtls_server())
        console = await ConsoleDouble(
            snapshot(decode_urls=(decode.url,), prefill_sites={"remote": (prefill.url,)})
        ).start(mtls_server())
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdbridge.cli", "gateway", "--deployment", "1",
            "--console", console.url, "--token", "node-token", "--port", "0",
            "--state-dir", str(tmp_path), "--tls-cert", str(gateway_cert.cert_file),
            "--tls-key", str(gateway_cert.key_file), "--ca-file", str(ca.ca_file),
            "--client-cert", str(gateway_cert.cert_file), "--client-key", str(gateway_cert.key_file),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=subprocess_env(),
        )  # fmt: skip
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            port = int(line.strip().rsplit(":", 1)[1])
            client_tls = ssl.create_default_context(cafile=str(ca.ca_file))
            async with aiohttp.ClientSession() as client:
                url = f"https://127.0.0.1:{port}"
                async with client.get(url + "/health", ssl=client_tls) as r:
                    health = await r.json()
                body = {"model": "tiny", "prompt": "word " * 200, "max_tokens": 3}
                async with client.post(url + "/v1/completions", json=body, ssl=client_tls) as r:
                    routed = (r.status, r.headers["x-pdbridge-path"])
                # The active probes reach the mTLS engines too: two rounds seen, none failed.
                probes: dict[str, float] = {}
                deadline = asyncio.get_running_loop().time() + 60
                while asyncio.get_running_loop().time() < deadline:
                    async with client.get(url + "/metrics", ssl=client_tls) as r:
                        text = await r.text()
                    probes = {"ok": 0.0, "failed": 0.0}
                    for line in text.splitlines():
                        if line.startswith("pdbridge_gateway_health_probes_total{"):
                            result = "ok" if 'result="ok"' in line else "failed"
                            probes[result] += float(line.rsplit(" ", 1)[1])
                    if probes["ok"] >= 4:
                        break
                    await asyncio.sleep(0.2)
                with_plain_http = None
                try:
                    async with client.get(f"http://127.0.0.1:{port}/health") as r:
                        with_plain_http = r.status
                except aiohttp.ClientError:
                    with_plain_http = "refused"
            return health, routed, with_plain_http, probes
        finally:
            proc.terminate()
            await proc.wait()
            for double in (console, decode, prefill):
                await double.stop()

    health, routed, with_plain_http, probes = asyncio.run(scenario())

    assert (health["status"], health["config_version"]) == ("ok", 3)
    assert [(p["role"], p["healthy"], p["total"]) for p in health["pools"]] == [
        ("decode", 1, 1),
        ("prefill", 1, 1),
    ]
    assert probes["ok"] >= 4
    assert probes["failed"] == 0
    assert routed == (200, "remote")
    assert with_plain_http in ("refused", 400)


def _listening_event(tmp_path, settings_text):
    config = tmp_path / "snapshot.json"
    config.write_text(json.dumps(snapshot(version=3)))
    settings = tmp_path / "settings.yaml"
    settings.write_text(settings_text)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "gateway", "--config", str(config),
         "--settings", str(settings), "--insecure", "--port", "0", "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("pdbridge gateway listening on"), proc.stderr.read()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)
    docs = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return next(doc for doc in docs if doc["event"] == "gateway.listening")


def test_event_loop_setting_picks_the_loop(tmp_path):
    """``auto`` runs on uvloop when it is installed (it is a dependency), ``asyncio`` forces
    the standard loop; the listening event says which one serves."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        expected_auto = "asyncio"
    else:
        expected_auto = "uvloop"
    assert _listening_event(tmp_path, "event_loop: auto\n")["event_loop"] == expected_auto
    assert _listening_event(tmp_path, "event_loop: asyncio\n")["event_loop"] == "asyncio"


def test_loop_factory_without_uvloop_installed(monkeypatch):
    """Optional-safe: ``auto`` falls back to asyncio's loop, ``uvloop`` is a named error."""
    from agents.gateway.cli import loop_factory
    from agents.gateway.config import ConfigError

    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes ``import uvloop`` fail
    assert loop_factory("auto") is None
    with pytest.raises(ConfigError, match=r"settings\.event_loop: uvloop is not installed"):
        loop_factory("uvloop")
