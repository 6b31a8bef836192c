"""Agent configuration: YAML, environment overrides, errors naming the key, docs coverage."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.config import ConfigError, load_config, reference
from tests.agents.pki import Pki
from tests.support import repo_root


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return path


def test_yaml_and_environment_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "node: {name: pre-1, site: remote}\ninsecure: true\n"
        "faults: {peers: {local: {addresses: [10.0.0.5]}}}\n"
        "engines: {mine: {argv: ['{python}', '-m', 'x', '{port}']}}\n",
    )
    env = {
        "PDBRIDGE_AGENT__CONSOLE__URL": "https://console.example",
        "PDBRIDGE_AGENT__SUPERVISION__CRASH_LOOP_LIMIT": "7",
        "PDBRIDGE_AGENT__CAPACITY__ACCELERATORS": "[{type: H200, count: 8, memory_gib: 141}]",
    }
    config = load_config(path, env)
    assert config.node.name == "pre-1"
    assert config.console.url == "https://console.example"
    assert config.supervision.crash_loop_limit == 7
    assert config.capacity.accelerators == [{"type": "H200", "count": 8, "memory_gib": 141}]
    assert config.faults.peers["local"].addresses == ["10.0.0.5"]
    assert config.engines["mine"].health_path == "/health"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node: {site: s}\ninsecure: true\n", "node.name: required"),
        ("node: {name: n, site: s}\n", "tls.ca: required unless insecure: true"),
        (
            "node: {name: n, site: s}\ninsecure: true\nlisten: nowhere\n",
            "listen: expected host:port, got 'nowhere'",
        ),
        ("node: {name: n, site: s}\ninsecure: true\nsupervison: {}\n", "supervison: unknown key"),
        ("node: {name: n, site: s}\ninsecure: yes-please\n", "insecure: expected true or false"),
        (
            "node: {name: n, site: s}\ninsecure: true\nfaults: {mechanism: magic}\n",
            "faults.mechanism: one of auto, interface, route, proxy",
        ),
        (
            "node: {name: n, site: s}\ninsecure: true\nengines: {e: {argv: []}}\n",
            "engines.e.argv: required",
        ),
        (
            "node: {name: n, site: s}\ninsecure: true\nconsole: {url: ftp://x}\n",
            "console.url: must start with http:// or https://",
        ),
        (
            "node: {name: n, site: s}\ninsecure: true\nfaults: {peers: {r: {ports: [7071, 0]}}}\n",
            "faults.peers.r.ports[1]: between 1 and 65535",
        ),
        ("- just\n- a list\n", "--config: top level must be a mapping"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text), {})
    assert str(err.value) == message


def test_environment_error_names_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "node: {name: n, site: s}\ninsecure: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {"PDBRIDGE_AGENT__SUPERVISION__STOP_GRACE_S": "soon"})
    assert str(err.value) == "supervision.stop_grace_s: expected a number"


def test_every_key_is_documented_once_and_in_the_docs() -> None:
    rows = reference()
    keys = [key for key, _, _ in rows]
    assert len(keys) == len(set(keys))
    assert all(doc for _, _, doc in rows)
    docs = (repo_root() / "docs" / "agent.md").read_text()
    missing = [key for key in keys if f"`{key}`" not in docs]
    assert missing == []


def test_unreadable_tls_material_names_the_key(tmp_path: Path, pki: Pki) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    other_key = pki.client("intruder")[1]  # a real key, not the agent certificate's

    def error(ca: Path, cert: Path, key: Path) -> str:
        path = _write(
            tmp_path, f"node: {{name: n, site: s}}\ntls: {{ca: {ca}, cert: {cert}, key: {key}}}\n"
        )
        with pytest.raises(ConfigError) as err:
            load_config(path, {})
        return str(err.value)

    assert error(garbage, pki.agent_cert, pki.agent_key).startswith(
        "tls.ca: not a PEM CA certificate"
    )
    assert error(pki.ca, garbage, pki.agent_key).startswith(
        "tls.cert: not a PEM certificate matching tls.key"
    )
    assert error(pki.ca, pki.agent_cert, other_key).startswith(
        "tls.cert: not a PEM certificate matching tls.key"
    )
    good = _write(
        tmp_path,
        f"node: {{name: n, site: s}}\n"
        f"tls: {{ca: {pki.ca}, cert: {pki.agent_cert}, key: {pki.agent_key}}}\n",
    )
    assert load_config(good, {}).tls.cert == str(pki.agent_cert)
