"""Launch adapters of the non-engine children: the kv-link receiver and the gateway.

Both run their own ``pdbridge`` subcommand with the agent's TLS material (the node's
certificate), so a node has one identity for its control API, its KV link and its gateway.
See :class:`agents.launch.ChildAdapter` for the contract.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

from agents.config import AgentConfig
from agents.launch import ChildAdapter, ChildSpec, LaunchError, LaunchPlan, health_host, pick_port


def _check_settings(spec: ChildSpec, allowed: set[str]) -> dict[str, Any]:
    for key in sorted(spec.settings):
        if key not in allowed:
            raise LaunchError(
                f"settings.{key}",
                f"not a setting of {spec.kind}; known: {', '.join(sorted(allowed))}",
            )
    return dict(spec.settings)


def _positive(settings: dict[str, Any], key: str) -> str | None:
    value = settings.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise LaunchError(f"settings.{key}", "must be a positive number")
    return str(value)


class KvLinkAdapter(ChildAdapter):
    """``pdbridge kv serve``: the KV receiver a peer site's senders push to.

    settings: ``host`` (bind address, default ``0.0.0.0``: peers dial it over the WAN),
    ``port``, ``allow_peers`` (certificate common names of the sending sites' nodes; default: any
    certificate of the CA), ``memory_budget_mb``, ``max_chunk_mb``, ``ttl_s``. Health: the
    receiver's metrics endpoint, which it opens only once the gRPC server is up.
    """

    SETTINGS: ClassVar[set[str]] = {
        "host",
        "port",
        "allow_peers",
        "memory_budget_mb",
        "max_chunk_mb",
        "ttl_s",
    }

    def __init__(self, argument: str, config: AgentConfig) -> None:
        self.config = config

    def plan(self, spec: ChildSpec, port: int, snapshot_path: str) -> LaunchPlan:
        settings = _check_settings(spec, self.SETTINGS)
        host = str(settings.get("host") or "0.0.0.0")  # noqa: S104  (a WAN-facing receiver)
        metrics_port = pick_port(None)
        argv = [sys.executable, "-m", "pdbridge.cli", "kv", "serve", "--bind", f"{host}:{port}"]
        argv += ["--metrics-port", str(metrics_port)]
        for key, flag in (
            ("memory_budget_mb", "--memory-budget-mb"),
            ("max_chunk_mb", "--max-chunk-mb"),
            ("ttl_s", "--ttl-s"),
        ):
            value = _positive(settings, key)
            if value is not None:
                argv += [flag, value]
        peers = settings.get("allow_peers") or []
        if not isinstance(peers, list) or not all(isinstance(p, str) and p for p in peers):
            raise LaunchError("settings.allow_peers", "a list of certificate names")
        if self.config.insecure:
            if peers:
                raise LaunchError("settings.allow_peers", "needs TLS; this agent runs insecure")
            argv.append("--insecure")
        else:
            tls = self.config.tls
            argv += ["--ca", tls.ca, "--cert", tls.cert, "--key", tls.key]
            for peer in peers:
                argv += ["--allow-peer", peer]
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"  # kv serve binds metrics to loopback
        return LaunchPlan(argv=argv, port=port, health_url=metrics, metrics_url=metrics)


class GatewayAdapter(ChildAdapter):
    """``pdbridge gateway``: the OpenAI-compatible router of one deployment.

    Needs ``deployment_id`` in the Launch request; with ``console.url`` configured the
    gateway polls the console's config snapshot with this node's token (passed in its
    environment, never on the command line), otherwise it serves the snapshot the Launch
    named. settings: ``host`` (default ``0.0.0.0``), ``port``, ``settings_file`` (gateway
    settings YAML on this node). Health: ``/health`` (503 until it has a config).
    """

    SETTINGS: ClassVar[set[str]] = {"host", "port", "settings_file"}

    def __init__(self, argument: str, config: AgentConfig) -> None:
        self.config = config

    def plan(self, spec: ChildSpec, port: int, snapshot_path: str) -> LaunchPlan:
        settings = _check_settings(spec, self.SETTINGS)
        if spec.deployment_id <= 0:
            raise LaunchError("deployment_id", "required for a gateway")
        host = str(settings.get("host") or "0.0.0.0")  # noqa: S104  (clients reach it)
        argv = [
            sys.executable,
            "-m",
            "pdbridge.cli",
            "gateway",
            "--host",
            host,
            "--port",
            str(port),
        ]
        env: dict[str, str] = {}
        if self.config.console.url:
            argv += ["--deployment", str(spec.deployment_id), "--console", self.config.console.url]
            env["PDBRIDGE_GATEWAY_TOKEN"] = self.config.node_token()
        elif snapshot_path:
            argv += ["--config", snapshot_path]
        else:
            raise LaunchError(
                "config_version", "required for a gateway when the agent has no console.url"
            )
        argv += ["--state-dir", f"{self.config.state_dir}/gateway-{spec.name}"]
        if settings.get("settings_file"):
            argv += ["--settings", str(settings["settings_file"])]
        if self.config.insecure:
            argv.append("--insecure")
        else:
            tls = self.config.tls
            argv += ["--tls-cert", tls.cert, "--tls-key", tls.key, "--ca-file", tls.ca]
            argv += ["--client-cert", tls.cert, "--client-key", tls.key]
        scheme = "http" if self.config.insecure else "https"
        return LaunchPlan.served(
            argv,
            port,
            f"{scheme}://{health_host(host)}:{port}",
            env,
            tls_server_name="" if self.config.insecure else _own_server_name(self.config),
        )


def _own_server_name(config: AgentConfig) -> str:
    """The name this node's certificate answers to (a child serving it is checked against
    it when the agent dials the child on loopback); empty when it cannot be read -- the
    health check then names the problem as a failed TLS handshake. Reads a small file."""
    from grpc_kv.tls import certificate_server_name

    try:
        return certificate_server_name(Path(config.tls.cert).read_bytes()) or ""
    except (OSError, ValueError):
        return ""
