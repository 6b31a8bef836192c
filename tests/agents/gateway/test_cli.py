"""``pdbridge gateway`` as a real child process."""

import json
import subprocess
import sys
import time
import urllib.request

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

    assert health == {"status": "ok", "config_version": 7}
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
