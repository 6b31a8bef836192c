"""Typed configuration of the node agent (``pdbridge agent --config agent.yaml``).

Every knob is a dataclass field whose ``metadata["doc"]`` is its one and only documentation;
``pdbridge agent --config-reference`` prints the table that ``docs/agent.md`` carries.

Sources, later wins: field defaults, the YAML file, environment variables named
``PDBRIDGE_AGENT__<SECTION>__<KEY>`` (``PDBRIDGE_AGENT__CONSOLE__TOKEN=...``; values are parsed
as YAML scalars/lists). Errors raise :class:`ConfigError` naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "PDBRIDGE_AGENT__"


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message starts with the dotted key."""


def _doc(text: str, **kwargs: Any) -> Any:
    return field(metadata={"doc": text}, **kwargs)


@dataclass
class NodeConfig:
    name: str = _doc("Node hostname as registered in the console (required).", default="")
    site: str = _doc("Site (datacenter) this node belongs to (required).", default="")


@dataclass
class TLSConfig:
    ca: str = _doc("PEM file of the CA that signs controller (client) certificates.", default="")
    cert: str = _doc("PEM certificate of this agent's control API.", default="")
    key: str = _doc("PEM private key of ``tls.cert``.", default="")
    allowed_identities: list[str] = _doc(
        "Controller identities allowed to call the control API: certificate common names, "
        "matched exactly (a SAN never matches); empty refuses every caller.",
        default_factory=list,
    )


@dataclass
class ConsoleConfig:
    url: str = _doc(
        "Console base URL (``https://console.example``); empty disables heartbeats.", default=""
    )
    token: str = _doc("Node token (``Authorization: Bearer``) issued by the console.", default="")
    token_file: str = _doc(
        "File holding the node token (read at start; wins over ``console.token``).", default=""
    )
    ca: str = _doc(
        "CA bundle used to verify the console's HTTPS certificate (default: system).", default=""
    )
    heartbeat_interval_s: float = _doc(
        "Seconds between heartbeats until the console says otherwise (its ``interval_s``).",
        default=10.0,
    )
    timeout_s: float = _doc("Deadline of each heartbeat / config fetch HTTP request.", default=5.0)
    backoff_max_s: float = _doc(
        "Longest wait between heartbeats while the console is unreachable.", default=60.0
    )


@dataclass
class SupervisionConfig:
    readiness_timeout_s: float = _doc(
        "How long a launched child may take to answer its health endpoint.", default=120.0
    )
    health_interval_s: float = _doc(
        "Seconds between health checks of a running child.", default=2.0
    )
    health_failures: int = _doc(
        "Consecutive failed health checks after which a child is restarted.", default=3
    )
    stop_grace_s: float = _doc(
        "Grace between SIGTERM and SIGKILL when stopping a child's process group.", default=10.0
    )
    backoff_initial_s: float = _doc(
        "First restart delay after a crash; doubles per crash.", default=0.5
    )
    backoff_max_s: float = _doc("Longest restart delay.", default=30.0)
    crash_loop_limit: int = _doc(
        "Crashes within ``crash_loop_window_s`` after which a child is marked failed.", default=5
    )
    crash_loop_window_s: float = _doc("Window over which crashes are counted.", default=300.0)
    max_children: int = _doc("Most children this agent will run at once.", default=16)
    limit_nofile: int = _doc(
        "Open-file limit of each child (0: inherited from the agent).", default=0
    )
    limit_nproc: int = _doc("Process/thread limit of each child's user (0: inherited).", default=0)
    limit_as_mb: int = _doc(
        "Address-space limit of each child in MiB (0: none; GPU engines need it off).", default=0
    )
    log_max_bytes: int = _doc("Size at which a child's log file rotates.", default=10 * 1024 * 1024)
    log_backups: int = _doc("Rotated log files kept per child.", default=3)


@dataclass
class PeerConfig:
    addresses: list[str] = _doc(
        "Peer site's addresses (IPs or CIDRs) for blackhole-route link cuts.", default_factory=list
    )
    interface: str = _doc(
        "WAN interface towards this peer (overrides ``faults.wan_interface``).", default=""
    )
    ports: list[int] = _doc(
        "The peer's kv-link (TCP) ports: a ``route`` cut then drops only TCP to these ports "
        "on ``addresses`` (policy rules), so other traffic to the peer (the control plane) "
        "still flows; empty: every packet to ``addresses``.",
        default_factory=list,
    )


@dataclass
class ProxyConfig:
    listen: str = _doc(
        "host:port the agent's fault proxy listens on (kv-link senders dial it).", default=""
    )
    upstream: str = _doc(
        "host:port of the peer site's kv-link receiver behind the proxy.", default=""
    )


@dataclass
class FaultsConfig:
    max_duration_s: float = _doc("Longest expiry a fault may carry.", default=3600.0)
    mechanism: str = _doc(
        "How link faults act: ``interface`` (``ip link set DEV down``, root), ``route`` "
        "(blackhole routes to the peer's addresses, root), ``proxy`` (the userspace fault "
        "proxy of ``faults.proxies``) or ``auto`` (kernel when root and configured: route if "
        "the peer has addresses, else interface; otherwise the proxy).",
        default="auto",
    )
    wan_interface: str = _doc("Default WAN interface used by ``link_*`` faults.", default="")
    wan_netns: str = _doc(
        "Network namespace holding the WAN interface (empty: the agent's own).", default=""
    )
    proxies: dict[str, ProxyConfig] = _doc(
        "Userspace fault proxies by peer site, started with the agent (``faults.proxies.<site>.listen`` / ``.upstream``).",
        default_factory=dict,
    )
    peers: dict[str, PeerConfig] = _doc(
        "Peer sites by name (``faults.peers.<site>.addresses`` / ``.ports`` / ``.interface``).",
        default_factory=dict,
    )


@dataclass
class CustomEngineConfig:
    argv: list[str] = _doc(
        "Command line; ``{port}``, ``{python}``, ``{kind}``, ``{name}`` and ``{settings.<key>}`` are substituted.",
        default_factory=list,
    )
    health_path: str = _doc("HTTP path answering 200 when the child is ready.", default="/health")
    metrics_path: str = _doc(
        "HTTP path of the child's Prometheus metrics (empty: none).", default="/metrics"
    )
    env: dict[str, str] = _doc("Extra environment variables of the child.", default_factory=dict)


@dataclass
class CapacityConfig:
    accelerators: list[dict[str, Any]] = _doc(
        "Accelerators reported in heartbeats (``[{type, count, memory_gib}]``); empty: detected with nvidia-smi when present.",
        default_factory=list,
    )
    memory_gib: float = _doc(
        "Host memory reported in heartbeats; 0: read from /proc/meminfo.", default=0.0
    )


@dataclass
class AgentConfig:
    node: NodeConfig = field(default_factory=NodeConfig)
    listen: str = _doc(
        "host:port of the gRPC control API (port 0 picks a free port).", default="127.0.0.1:7070"
    )
    insecure: bool = _doc(
        "Serve the control API without TLS (loopback development only).", default=False
    )
    tls: TLSConfig = field(default_factory=TLSConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    state_dir: str = _doc(
        "Directory for the fault journal, child logs and the address file.",
        default="/var/lib/pdbridge-agent",
    )
    metrics_listen: str = _doc(
        "host:port of the Prometheus endpoint (empty disables it).", default="127.0.0.1:0"
    )
    default_deadline_s: float = _doc(
        "Deadline applied to control calls that arrive without one.", default=30.0
    )
    request_id_ttl_s: float = _doc(
        "How long a request id's answer is remembered for retries.", default=600.0
    )
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    engine_executables: dict[str, list[str]] = _doc(
        "Command prefix per built-in engine (``vllm: [/opt/vllm/bin/vllm]``); default: the engine's own.",
        default_factory=dict,
    )
    engines: dict[str, CustomEngineConfig] = _doc(
        "Custom engine adapters by name, declared only here (never over the wire).",
        default_factory=dict,
    )
    models: dict[str, str] = _doc(
        "Model checkpoints this node holds, by catalog model name (``tiny: /models/tiny``: a "
        "checkpoint directory or weights file); their sha256 is reported in heartbeats. Engines "
        "the agent runs are reported as well without being listed here.",
        default_factory=dict,
    )

    def validate(self) -> None:
        """Raise :class:`ConfigError` for the first invalid key."""
        if not self.node.name:
            raise ConfigError("node.name: required")
        if not self.node.site:
            raise ConfigError("node.site: required")
        split_host_port(self.listen, "listen")
        if self.metrics_listen:
            split_host_port(self.metrics_listen, "metrics_listen")
        if not self.insecure:
            for key in ("ca", "cert", "key"):
                path = getattr(self.tls, key)
                if not path:
                    raise ConfigError(f"tls.{key}: required unless insecure: true")
                if not Path(path).is_file():
                    raise ConfigError(f"tls.{key}: no such file {path!r}")
            # Unreadable PEM would otherwise surface as an ssl traceback deep in start-up.
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                context.load_verify_locations(cafile=self.tls.ca)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(f"tls.ca: not a PEM CA certificate: {exc}") from None
            try:
                # An empty password: an encrypted key fails here instead of prompting on a tty
                # (grpc could not use it either).
                context.load_cert_chain(self.tls.cert, self.tls.key, password=lambda: b"")
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(
                    f"tls.cert: not a PEM certificate matching tls.key: {exc}"
                ) from None
        if self.console.url and not self.console.url.startswith(("http://", "https://")):
            raise ConfigError("console.url: must start with http:// or https://")
        if self.faults.mechanism not in {"auto", "interface", "route", "proxy"}:
            raise ConfigError("faults.mechanism: one of auto, interface, route, proxy")
        for site, peer in self.faults.peers.items():
            for i, port in enumerate(peer.ports):
                if not 1 <= port <= 65535:
                    raise ConfigError(f"faults.peers.{site}.ports[{i}]: between 1 and 65535")
        for site, proxy in self.faults.proxies.items():
            split_host_port(proxy.listen, f"faults.proxies.{site}.listen")
            split_host_port(proxy.upstream, f"faults.proxies.{site}.upstream")
        for name, path in self.models.items():
            if not path:
                raise ConfigError(f"models.{name}: a checkpoint path")
        for name, engine in self.engines.items():
            if not engine.argv:
                raise ConfigError(f"engines.{name}.argv: required")
        for key in ("limit_nofile", "limit_nproc", "limit_as_mb"):
            if getattr(self.supervision, key) < 0:
                raise ConfigError(f"supervision.{key}: must not be negative")
        for key in ("crash_loop_limit", "max_children", "log_backups", "health_failures"):
            if getattr(self.supervision, key) < 1:
                raise ConfigError(f"supervision.{key}: must be at least 1")

    def node_token(self) -> str:
        if self.console.token_file:
            try:
                return Path(self.console.token_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"console.token_file: {exc}") from exc
        return self.console.token


def split_host_port(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: expected host:port, got {value!r}")
    return host.strip("[]"), int(port)


def _convert(value: Any, annotation: Any, key: str) -> Any:
    """Convert a YAML value to the annotated type, raising ConfigError naming ``key``."""
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping")
        return _build(annotation, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list")
        (item,) = typing.get_args(annotation)
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping")
        _, item = typing.get_args(annotation)
        return {str(k): _convert(v, item, f"{key}.{k}") for k, v in value.items()}
    if annotation is Any or isinstance(annotation, types.GenericAlias):
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false")
        return value
    if annotation in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number")
        if annotation is int and int(value) != value:
            raise ConfigError(f"{key}: expected an integer")
        return annotation(value)
    if annotation is str:
        if value is None:
            return ""
        if not isinstance(value, str | int | float):
            raise ConfigError(f"{key}: expected a string")
        return str(value)
    return value


def _build(cls: Any, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key)
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(f"{dotted}: unknown key")
        kwargs[key] = _convert(value, hints[key], dotted)
    return cls(**kwargs)


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        child = data.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: parent is not a mapping")
        data = child
    data[path[-1]] = value


def load_config(
    path: str | os.PathLike[str] | None, environ: dict[str, str] | None = None
) -> AgentConfig:
    """Load and validate the agent config. Called once at agent start (blocking file read).

    Raises :class:`ConfigError` naming the key for any bad value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"--config: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config: invalid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError("--config: top level must be a mapping")
        data = loaded
    env = os.environ if environ is None else environ
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: invalid value: {exc}") from exc
        _set_path(data, parts, value)
    config: AgentConfig = _build(AgentConfig, data, "")
    config.validate()
    return config


def reference(cls: Any = AgentConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """Rows ``(key, default, doc)`` for every documented knob, for docs and ``--config-reference``."""
    rows: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            rows += reference(annotation, f"{key}.")
            continue
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        else:
            default = f.default_factory()  # type: ignore[operator]
        rows.append((key, repr(default), f.metadata.get("doc", "")))
        if typing.get_origin(annotation) is dict:
            item = typing.get_args(annotation)[1]
            if dataclasses.is_dataclass(item):
                rows += reference(item, f"{key}.<name>.")
    return rows
