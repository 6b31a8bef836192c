"""deploy/ is checked without a cluster: manifests parse, carry the fields a cluster needs,
reference only documented variables and the CLI's real commands, and hold no secrets."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest
import yaml

from pdbridge.cli import COMMANDS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCS = Path(__file__).resolve().parents[2] / "docs"
WORKLOAD_KINDS = {"Deployment", "DaemonSet", "Job", "StatefulSet"}


def k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def test_every_manifest_has_api_version_kind_name_and_namespace():
    docs = k8s_documents()

    assert len(docs) >= 10
    for name, doc in docs:
        assert doc.get("apiVersion"), name
        assert doc.get("kind"), name
        assert doc["metadata"].get("name"), name
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "pdbridge", (name, doc["metadata"]["name"])


def test_the_required_components_are_all_there():
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in k8s_documents()}

    assert {
        ("Deployment", "pdbridge-console"),
        ("Service", "pdbridge-console"),
        ("Job", "pdbridge-migrate"),
        ("Deployment", "pdbridge-worker"),
        ("Deployment", "pdbridge-beat"),
        ("DaemonSet", "pdbridge-agent-local"),
        ("DaemonSet", "pdbridge-agent-remote"),
        ("Deployment", "pdbridge-gateway"),
        ("Service", "pdbridge-gateway"),
    } <= kinds


def test_workloads_have_images_resources_and_matching_selectors():
    for name, doc in k8s_documents():
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        for container in pod_spec(doc)["containers"]:
            assert container["image"], name
            assert container["resources"]["requests"], (name, container["name"])
            assert "memory" in container["resources"]["limits"], (name, container["name"])
        if doc["kind"] in {"Deployment", "DaemonSet"}:
            assert (
                doc["spec"]["selector"]["matchLabels"].items()
                <= doc["spec"]["template"]["metadata"]["labels"].items()
            ), name


def test_beat_is_a_singleton_that_never_overlaps():
    beat = next(doc for _, doc in k8s_documents() if doc["metadata"]["name"] == "pdbridge-beat")

    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"


def test_agents_request_gpus_and_stay_on_their_site():
    for site in ("local", "remote"):
        agent = next(
            doc
            for _, doc in k8s_documents()
            if doc["metadata"]["name"] == f"pdbridge-agent-{site}" and doc["kind"] == "DaemonSet"
        )
        spec = pod_spec(agent)
        assert spec["nodeSelector"] == {"pdbridge.io/site": site}
        assert "nvidia.com/gpu" in spec["containers"][0]["resources"]["limits"]


def test_container_commands_are_real_cli_commands():
    for name, doc in k8s_documents():
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        for container in pod_spec(doc)["containers"]:
            if "command" not in container:  # the image's entrypoint is `pdbridge`
                assert container["args"][0] in COMMANDS, (name, container["args"])


def test_services_point_at_named_container_ports():
    docs = k8s_documents()
    for _, service in (d for d in docs if d[1]["kind"] == "Service"):
        target = next(
            d
            for _, d in docs
            if d["kind"] == "Deployment"
            and d["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        )
        port_names = {p["name"] for c in pod_spec(target)["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def documented_variables() -> set[str]:
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", (DOCS / "configuration.md").read_text()))


def test_every_production_variable_is_documented():
    lines = [
        line
        for line in (DEPLOY / "production.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    names = {line.split("=", 1)[0] for line in lines}

    assert names <= documented_variables()
    config_map = next(
        doc
        for _, doc in k8s_documents()
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "pdbridge-config"
    )
    assert set(config_map["data"]) <= documented_variables()


@pytest.mark.parametrize(
    "unit", sorted((DEPLOY / "systemd").glob("*.service")), ids=lambda p: p.name
)
def test_systemd_units_parse_and_run_real_commands(unit):
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(unit)

    assert parser["Unit"]["Description"]
    service = parser["Service"]
    assert service["Restart"] in {"always", "on-failure"}
    assert parser["Install"]["WantedBy"] == "multi-user.target"
    exec_start = service["ExecStart"].split()
    if exec_start[0].endswith("/pdbridge"):
        assert exec_start[1] in COMMANDS
    else:
        assert exec_start[0].endswith("/gunicorn")
        assert exec_start[1] == "console.wsgi:application"


def test_no_secrets_in_deploy():
    secret_like = re.compile(
        r"(BEGIN [A-Z ]*PRIVATE KEY|SECRET_KEY=[^<\s]|password=[^<\s]|://[^:/\s]+:[^<@\s]+@)",
        re.IGNORECASE,
    )
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert not secret_like.search(path.read_text()), path


def test_dockerfile_copies_every_top_level_package():
    dockerfile = (DEPLOY / "Dockerfile").read_text()

    for package in ("pdbridge", "console", "orchestrator", "agents", "grpc_kv"):
        assert f"COPY {package} {package}" in dockerfile


@pytest.mark.parametrize("site", ["local", "remote"])
def test_agent_config_in_the_manifest_loads_with_the_agents_own_loader(site, tmp_path):
    from agents.config import load_config
    from grpc_kv.certs import create_ca, create_node_cert

    config_map = next(
        doc
        for _, doc in k8s_documents()
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == f"pdbridge-agent-{site}"
    )
    path = tmp_path / "agent.yaml"
    path.write_text(config_map["data"]["agent.yaml"])
    # Real PEM material: the loader checks that the CA parses and the key matches the cert.
    ca = create_ca(tmp_path / "ca")
    node = create_node_cert(ca, tmp_path / "nodes", "gpu-node-1", loopback=True)
    environ = {
        "PDBRIDGE_AGENT__NODE__NAME": "gpu-node-1",
        "PDBRIDGE_AGENT__TLS__CA": str(ca.ca_file),
        "PDBRIDGE_AGENT__TLS__CERT": str(node.cert_file),
        "PDBRIDGE_AGENT__TLS__KEY": str(node.key_file),
    }

    config = load_config(path, environ=environ)

    assert (config.node.name, config.node.site) == ("gpu-node-1", site)
    assert config.console.token_file == "/etc/pdbridge/secrets/node-token"
    assert config.tls.allowed_identities == ["pdbridge-controller"]


def test_gateway_arguments_parse_with_the_gateways_own_parser():
    from agents.gateway.cli import _parser

    gateway = next(
        doc
        for _, doc in k8s_documents()
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "pdbridge-gateway"
    )
    container = pod_spec(gateway)["containers"][0]
    env = {item["name"]: item.get("value", "") for item in container["env"]}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]

    parsed = _parser().parse_args(args[1:])

    assert parsed.console.startswith("https://")
    assert parsed.insecure is False
    assert parsed.tls_cert is not None
