"""What to run for a ``Launch``: child specs, launch plans and the adapter registry.

A :class:`ChildSpec` is what the controller asked for (kind, engine, settings, config
version). A :class:`ChildAdapter` turns it into a :class:`LaunchPlan` (command line, health
URL). Adapters sit behind a lazy name -> ``module:attr`` registry so that the agent imports
engine code only when a child of that engine is launched.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import importlib
import json
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agents.config import AgentConfig, CustomEngineConfig

KINDS = ("prefill-engine", "decode-engine", "kv-link", "gateway")
ENGINE_KINDS = ("prefill-engine", "decode-engine")


class LaunchError(ValueError):
    """Bad launch input; ``field`` names the offending request field, ``code`` the gRPC code
    name the control API answers with (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION)."""

    def __init__(self, field_name: str, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.code = code


@dataclass(frozen=True)
class ChildSpec:
    """A child as the controller asked for it; two equal fingerprints mean nothing to do."""

    name: str
    kind: str
    engine: str
    settings: dict[str, Any]
    config_version: int = 0
    deployment_id: int = 0

    def fingerprint(self) -> str:
        body = json.dumps(
            [self.kind, self.engine, self.settings, self.config_version, self.deployment_id],
            sort_keys=True,
        )
        return hashlib.sha256(body.encode()).hexdigest()


@dataclass(frozen=True)
class LaunchPlan:
    """How to run one child process. ``tls_server_name``: for a child served over HTTPS with
    this node's certificate, the name the agent expects in it when it calls ``health_url`` /
    ``metrics_url`` -- the certificate's own name, since a node certificate lists the node's
    names, not the loopback address the agent dials (empty: the URL's host)."""

    argv: list[str]
    port: int
    health_url: str
    metrics_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    tls_server_name: str = ""

    @classmethod
    def served(
        cls,
        argv: list[str],
        port: int,
        base: str,
        env: dict[str, str],
        tls_server_name: str = "",
    ) -> LaunchPlan:
        """A child that answers ``/health`` and ``/metrics`` under ``base`` (scheme://host:port)."""
        return cls(
            argv=argv,
            port=port,
            health_url=f"{base}/health",
            metrics_url=f"{base}/metrics",
            env=env,
            tls_server_name=tls_server_name,
        )


class ChildAdapter(abc.ABC):
    """Builds the launch plan of one engine or component.

    Contract: called by the supervisor on the event loop for every (re)launch, so it must not
    block; ``plan`` raises :class:`LaunchError` naming the settings key it rejects. It does not
    start anything itself.
    """

    @abc.abstractmethod
    def plan(self, spec: ChildSpec, port: int, snapshot_path: str) -> LaunchPlan:
        """See the class docstring."""


class CustomEngineAdapter(ChildAdapter):
    """An engine declared in ``agent.yaml`` (``engines.<name>``): a templated command line."""

    def __init__(self, config: CustomEngineConfig) -> None:
        self.config = config

    def plan(self, spec: ChildSpec, port: int, snapshot_path: str) -> LaunchPlan:
        values = {"port": str(port), "python": sys.executable, "kind": spec.kind, "name": spec.name}
        values.update({f"settings.{k}": str(v) for k, v in spec.settings.items()})

        def substitute(match: re.Match[str]) -> str:
            key = match.group(1)
            if key not in values:
                field_name = key if key.startswith("settings.") else f"argv {{{key}}}"
                raise LaunchError(field_name, "required by this engine's command line")
            return values[key]

        argv = [_PLACEHOLDER.sub(substitute, arg) for arg in self.config.argv]
        base = f"http://127.0.0.1:{port}"
        env = dict(self.config.env)
        if snapshot_path:
            env["PDBRIDGE_CONFIG_SNAPSHOT"] = snapshot_path
        return LaunchPlan(
            argv=argv,
            port=port,
            health_url=base + self.config.health_path,
            metrics_url=base + self.config.metrics_path if self.config.metrics_path else "",
            env=env,
        )


_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.-]+)\}")


def health_host(host: str) -> str:
    """Where the agent reaches a child bound to ``host`` (a wildcard means loopback)."""
    return "127.0.0.1" if host in {"", "0.0.0.0", "::"} else host  # noqa: S104


# Engine settings that choose what runs and with which environment: an authenticated
# controller still must not be able to run an arbitrary program (or LD_PRELOAD one) on a node.
NODE_ONLY = frozenset({"executable", "env", "api_key"})


class EngineRegistryAdapter(ChildAdapter):
    """Engine kinds through the engines' own adapter registry (``agents.engines.base``:
    ``reference``, ``vllm``). ``settings`` are :class:`agents.engines.base.EngineSpec` fields
    (``model`` required; ``role`` comes from the kind, ``port`` from the agent)."""

    ROLES: ClassVar[dict[str, str]] = {"prefill-engine": "prefill", "decode-engine": "decode"}

    def __init__(self, engine: str, config: AgentConfig) -> None:
        self.engine = engine
        self.config = config

    def plan(self, spec: ChildSpec, port: int, snapshot_path: str) -> LaunchPlan:
        from agents.engines.apikey import engine_api_key
        from agents.engines.base import AdapterError, EngineSpec, get_adapter

        allowed = {f.name for f in dataclasses.fields(EngineSpec)} - {"role"} - NODE_ONLY
        values = {k: v for k, v in spec.settings.items() if k != "port"}
        for key in sorted(values):
            if key in NODE_ONLY:
                raise LaunchError(
                    f"settings.{key}", "set on the node (agent.yaml), never over the wire"
                )
            if key not in allowed:
                raise LaunchError(f"settings.{key}", f"not a setting of the {self.engine} engine")
        executable = self.config.engine_executables.get(self.engine)
        if executable:
            values["executable"] = list(executable)
        if "model" not in values:
            raise LaunchError("settings.model", "required")
        try:
            # The engines' API key is the node's secret (environment or a secret file).
            values["api_key"] = engine_api_key(os.environ)
        except ValueError as exc:
            raise LaunchError("engine", str(exc)) from None
        try:
            engine_spec = EngineSpec(role=self.ROLES[spec.kind], port=port, **values)
            adapter = get_adapter(self.engine)(engine_spec)
            argv = adapter.command()
            env = adapter.environment()
        except AdapterError as exc:
            name, _, message = str(exc).partition(": ")
            raise LaunchError(name if name == "engine" else f"settings.{name}", message) from None
        except TypeError as exc:  # a setting of the wrong shape (e.g. a list for a string)
            raise LaunchError("settings", str(exc)) from None
        if snapshot_path:
            env["PDBRIDGE_CONFIG_SNAPSHOT"] = snapshot_path
        return LaunchPlan.served(argv, port, f"http://{health_host(engine_spec.host)}:{port}", env)


# Built-in adapters by name (engine name for engine kinds, the kind for kv-link / gateway):
# a factory ``module:attr`` and its argument. Loaded lazily: importing the agent must not
# import engine or gateway code.
ADAPTERS: dict[str, tuple[str, str]] = {
    "reference": ("agents.launch:EngineRegistryAdapter", "reference"),
    "vllm": ("agents.launch:EngineRegistryAdapter", "vllm"),
    "kv-link": ("agents.components:KvLinkAdapter", ""),
    "gateway": ("agents.components:GatewayAdapter", ""),
}


def resolve_adapter(spec: ChildSpec, config: AgentConfig) -> ChildAdapter:
    """The adapter for ``spec``; raises LaunchError (field ``engine``/``kind``) if none.
    Factories are called as ``factory(argument, config)``."""
    if spec.engine in config.engines:
        return CustomEngineAdapter(config.engines[spec.engine])
    key = spec.engine if spec.kind in ENGINE_KINDS else spec.kind
    entry = ADAPTERS.get(key)
    if entry is None:
        if spec.kind in ENGINE_KINDS:
            raise LaunchError("engine", f"unknown engine {spec.engine!r}")
        raise LaunchError(
            "kind", f"no adapter for {spec.kind!r} on this node", "FAILED_PRECONDITION"
        )
    target, argument = entry
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        field_name = "engine" if spec.kind in ENGINE_KINDS else "kind"
        raise LaunchError(
            field_name,
            f"adapter {target} for {key!r} is not installed on this node",
            "FAILED_PRECONDITION",
        ) from None
    adapter: ChildAdapter = factory(argument, config)
    return adapter


def validate_spec(spec: ChildSpec) -> None:
    """Reject malformed launch input before anything runs (LaunchError names the field)."""
    if spec.kind not in KINDS:
        raise LaunchError("kind", f"unknown kind {spec.kind!r}; one of {', '.join(KINDS)}")
    if spec.kind in ENGINE_KINDS and not spec.engine:
        raise LaunchError("engine", f"required for kind {spec.kind}")
    if (
        not spec.name
        or len(spec.name) > 64
        or not all(c.isalnum() or c in "-_." for c in spec.name)
    ):
        raise LaunchError("name", "1-64 characters of letters, digits, '-', '_' or '.'")
    if spec.config_version < 0:
        raise LaunchError("config_version", "must not be negative")
    if spec.config_version and spec.deployment_id <= 0:
        raise LaunchError("deployment_id", "required with config_version")
    port = spec.settings.get("port")
    if port is not None and (
        not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535
    ):
        raise LaunchError("settings.port", "an integer between 1 and 65535")


def pick_port(requested: int | None, host: str = "127.0.0.1") -> int:
    """The port a child will listen on: ``requested`` if free, else a free ephemeral port.

    Raises LaunchError (FAILED_PRECONDITION, field settings.port) when the requested port is
    taken. Blocking but instant (a bind attempt).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers do: connections of a child that just stopped (TIME_WAIT) must not make
        # its port look taken; a port another process listens on still fails to bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, requested or 0))
        except OSError as exc:
            raise LaunchError(
                "settings.port",
                f"port {requested} is in use ({exc.strerror})",
                "FAILED_PRECONDITION",
            ) from None
        port: int = sock.getsockname()[1]
        return port
