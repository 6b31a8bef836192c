"""The console is served by ``pdbridge serve`` in every deployment shape, with TLS where clients
reach it (in the pod, or in nginx with deadlines in front), and the liveness probe is set."""

from __future__ import annotations

import configparser
import dataclasses

import yaml

from pdbridge.console_server import ServerConfig, _parser
from tests.deploy.test_manifests import DEPLOY, k8s_documents, pod_spec


def _served(argv: list[str]) -> ServerConfig:
    args = _parser(ServerConfig()).parse_args(argv)
    config = dataclasses.replace(
        ServerConfig(), **{k: v for k, v in vars(args).items() if v is not None}
    )
    config.validate()
    return config


def test_the_k8s_console_serves_https_itself_and_is_probed_over_https():
    console = next(
        doc
        for _, doc in k8s_documents()
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "pdbridge-console"
    )
    container = pod_spec(console)["containers"][0]

    assert container["args"][0] == "serve"
    config = _served(container["args"][1:])
    assert (config.certfile, config.keyfile) == (
        "/etc/pdbridge/tls/tls.crt",
        "/etc/pdbridge/tls/tls.key",
    )
    assert config.bind == ["0.0.0.0:8443"]
    assert container["ports"] == [{"name": "https", "containerPort": 8443}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"


def test_agents_and_the_liveness_probe_reach_the_console_over_https():
    docs = {
        doc["metadata"]["name"]: doc for _, doc in k8s_documents() if doc["kind"] == "ConfigMap"
    }
    for site in ("local", "remote"):
        agent = yaml.safe_load(docs[f"pdbridge-agent-{site}"]["data"]["agent.yaml"])
        assert agent["console"]["url"] == "https://pdbridge-console.pdbridge.svc"
        assert agent["console"]["ca"]
    settings = docs["pdbridge-config"]["data"]
    assert settings["PDBRIDGE_LIVENESS_PROBE_URL"] == "https://pdbridge-console.pdbridge.svc"
    assert settings["PDBRIDGE_LIVENESS_PROBE_CA"].startswith("/etc/pdbridge/console-tls/")


def test_the_systemd_console_runs_pdbridge_serve_behind_nginx_with_deadlines():
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "systemd" / "pdbridge-console.service")
    service = parser["Service"]
    exec_start = service["ExecStart"].split()

    assert exec_start[:2] == ["/opt/pdbridge/.venv/bin/pdbridge", "serve"]
    assert _served(exec_start[2:]).bind == ["127.0.0.1:8000"]
    assert service["Type"] == "exec"  # pdbridge serve does not notify systemd
    nginx = (DEPLOY / "nginx" / "pdbridge-console.conf").read_text()
    assert "proxy_pass http://127.0.0.1:8000;" in nginx
    for directive in (
        "client_header_timeout 10s;",
        "client_body_timeout 30s;",
        "send_timeout 30s;",
        "proxy_request_buffering on;",
        "proxy_buffering on;",
    ):
        assert directive in nginx
