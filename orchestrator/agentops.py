"""Turns a deployment's pools into agent calls: which node runs which child, with which launch
settings, over which TLS channel.

Called by the deployment and canary workflow steps inside a Celery worker. Every function here
is blocking (it runs the async agent client on a private event loop) and raises
``grpc.aio.AioRpcError`` (agent refused or unreachable) or ``AgentOpsError`` (the deployment's
settings cannot be turned into a launch: the message names the ``engine_settings`` key).

Idempotency: a child's name is fixed per deployment and role (``dep<id>-prefill`` ...) and its
``Launch`` request id is derived from the run, the step's execution (``StepContext.execution``),
the node, the child and the launch settings, so a step re-executed after its worker died sends
the *same* request: the agent, which runs a Launch to its end even when its caller died, answers
it with that Launch's outcome -- also while it is still starting -- or (cache expired) finds
the same child with the same spec and answers ``unchanged``. Either way the engine is started
once. An operator's retry of the step is a new execution: its requests are new, so the agent
re-checks the child (and relaunches a ``failed`` one) instead of repeating an old answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.conf import settings

from agents.client import AgentClient
from console.core.controller import ControllerTlsMissing
from console.core.controller import controller_tls as console_controller_tls
from grpc_kv.tls import TLSConfig
from orchestrator.steps import StepContext

T = TypeVar("T")

#: pool engine_settings keys read by the orchestrator (the rest go to the engine adapter).
DEFAULT_ENGINE_PORT = 8000
DEFAULT_KV_PORT = 7100
DEFAULT_KV_LINK_PORT = 7101
DEFAULT_GATEWAY_PORT = 8080
_ENGINE_EXTRA = ("threads", "models_dir", "dtype", "kv_spool", "expect_sha256")
_ORCHESTRATOR_KEYS = {
    "engine",
    "port",
    "host",
    "kv_port",
    "kv_host",
    "kv_listen",
    "kv_link_port",
    "kv_link_wan_port",
    "kv_site_addresses",
    "kv_link_site_addresses",
    "gateway_port",
    "kv_tls",
    "kv_insecure",
    "http_insecure",
    "engine_host",
    "vllm_args",
    *_ENGINE_EXTRA,
}


class AgentOpsError(ValueError):
    """A deployment setting cannot be turned into an agent call (the message names it)."""


def controller_tls(server_name: str | None = None) -> TLSConfig:
    """The orchestrator's TLS identity towards agents (settings ``PDBRIDGE_CONTROLLER_*``)."""
    try:
        return console_controller_tls(server_name)
    except ControllerTlsMissing as exc:
        raise AgentOpsError(str(exc)) from None


def http_ssl_context(server_name_check: bool = True) -> ssl.SSLContext | None:
    """Client TLS context for HTTPS children (gateway) verified against the controller CA."""
    if settings.PDBRIDGE_CONTROLLER_INSECURE:
        return None
    context = ssl.create_default_context(cafile=settings.PDBRIDGE_CONTROLLER_TLS_CA)
    context.load_cert_chain(
        settings.PDBRIDGE_CONTROLLER_TLS_CERT, settings.PDBRIDGE_CONTROLLER_TLS_KEY
    )
    context.check_hostname = server_name_check
    return context


@dataclass(frozen=True)
class Target:
    """One node of one pool and what it should run."""

    role: str  # "prefill" | "decode"
    site: str
    hostname: str
    agent_address: str
    settings: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""  # the catalog's name of the deployment's model

    @property
    def served_model(self) -> str:
        """The model id the engine serves: a vLLM engine serves the catalog's name (its
        ``model`` is a checkpoint path); the reference engine the name of ``name=spec``."""
        if self.settings.get("engine") == "vllm" and self.model_name:
            return self.model_name
        spec = str(self.settings["model"])
        return spec.split("=", 1)[0] if "=" in spec else spec.split("@", 1)[0]

    @property
    def host(self) -> str:
        """Where the orchestrator and the gateway reach this node's children."""
        return str(self.settings.get("engine_host") or self.hostname)

    @property
    def engine_port(self) -> int:
        return _port(self.settings, "port", DEFAULT_ENGINE_PORT)

    @property
    def engine_url(self) -> str:
        return f"http://{self.host}:{self.engine_port}"

    @property
    def kv_wan_host(self) -> str:
        """Where prefill sites reach this decode node across the WAN: ``kv_host`` (a WAN
        proxy or NAT address in front of it) or the node's host."""
        return str(self.settings.get("kv_host") or self.host)

    @property
    def kv_address(self) -> str:
        """What prefill engines dial to reach this decode node's KV receiver."""
        return f"{self.kv_wan_host}:{_port(self.settings, 'kv_port', DEFAULT_KV_PORT)}"

    @property
    def kv_link_address(self) -> str:
        return f"{self.host}:{_port(self.settings, 'kv_link_port', DEFAULT_KV_LINK_PORT)}"

    @property
    def kv_link_wan_address(self) -> str:
        """What prefill sites dial to probe this decode node's kv-link across the WAN: like
        :attr:`kv_address`, ``kv_host`` with ``kv_link_wan_port`` when a proxy or NAT sits in
        front of the kv-link, else the kv-link itself. The probe must take the path the KV
        takes, or step 2 measures a link the KV never uses."""
        if "kv_link_wan_port" not in self.settings:
            return self.kv_link_address
        return (
            f"{self.kv_wan_host}:{_port(self.settings, 'kv_link_wan_port', DEFAULT_KV_LINK_PORT)}"
        )

    def kv_address_for(self, site: str) -> str:
        """What ``site``'s prefill engines dial for this decode node's KV receiver: its entry
        of ``kv_site_addresses`` (a WAN path, proxy or NAT of that site's own), else
        :attr:`kv_address`. The gateway reads the same setting."""
        return _site_address(self.settings, "kv_site_addresses", site) or self.kv_address

    def kv_link_wan_address_for(self, site: str) -> str:
        """What ``site``'s agent dials to probe this node's kv-link: its entry of
        ``kv_link_site_addresses``, else :attr:`kv_link_wan_address`."""
        return (
            _site_address(self.settings, "kv_link_site_addresses", site) or self.kv_link_wan_address
        )

    @property
    def gateway_port(self) -> int:
        return _port(self.settings, "gateway_port", DEFAULT_GATEWAY_PORT)


def _site_address(values: dict[str, Any], key: str, site: str) -> str:
    """``values[key][site]`` (a ``host:port``), "" when not set; AgentOpsError when malformed."""
    by_site = values.get(key) or {}
    if not isinstance(by_site, dict):
        raise AgentOpsError(f"engine_settings.{key}: an object of site -> host:port")
    address = by_site.get(site, "")
    if address and (not isinstance(address, str) or ":" not in address):
        raise AgentOpsError(f"engine_settings.{key}.{site}: host:port, got {address!r}")
    return str(address)


def _port(values: dict[str, Any], key: str, default: int) -> int:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise AgentOpsError(f"engine_settings.{key}: a port number, got {value!r}")
    return value


def targets(config: dict[str, Any], role: str) -> list[Target]:
    """The nodes of the ``role`` pools of a config document (model engine settings merged
    under each pool's). Raises AgentOpsError for a pool without nodes."""
    base = dict(config["model"].get("engine_settings") or {})
    pools = config["pools"]
    docs = [pools["decode"]] if role == "decode" else list(pools["prefill"])
    out = []
    for pool in docs:
        if pool is None or not pool["nodes"]:
            site = pool["site"] if pool else "?"
            raise AgentOpsError(f"pools.{role}: the pool at {site} has no nodes")
        merged = {**base, **(pool.get("engine_settings") or {})}
        for node in pool["nodes"]:
            if not node.get("agent_address"):
                raise AgentOpsError(f"nodes.{node['hostname']}.agent_address: empty")
            out.append(
                Target(
                    role,
                    pool["site"],
                    node["hostname"],
                    node["agent_address"],
                    merged,
                    str(config["model"].get("name") or ""),
                )
            )
    return out


def engine_launch_settings(target: Target, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(engine adapter name, Launch settings) of the engine on ``target``."""
    s = target.settings
    if "model" not in s:
        raise AgentOpsError("engine_settings.model: required (the engine's model spec)")
    extra = {k: s[k] for k in _ENGINE_EXTRA if k in s}
    launch: dict[str, Any] = {
        "model": s["model"],
        "host": str(s.get("host") or "127.0.0.1"),
        "port": target.engine_port,
        "chunked_prefill_tokens": int(config["prefill"]["chunked_prefill_tokens"]),
        "kv_connector_extra_config": extra,
    }
    engine = str(s.get("engine") or "reference")
    if engine == "vllm":
        return engine, _vllm_launch(target, config, launch)
    args: list[str] = []
    if target.role == "decode":
        listen = s.get("kv_listen") or f"{launch['host']}:{_port(s, 'kv_port', DEFAULT_KV_PORT)}"
        args += ["--kv-listen", str(listen)]
    kvt = config["kv_transfer"]
    # The deployment's link settings, not the engine's defaults: a prefill engine on grpc_kv's
    # 4 s deadline gives up on a transfer the deployment allows 15 s for.
    args += [
        "--kv-compression",
        str(kvt["compression"]),
        "--kv-timeout-ms",
        str(int(kvt["timeout_ms"])),
        "--kv-retry",
        str(int(kvt["retry"])),
        "--kv-chunk-size-mb",
        str(float(kvt["chunk_size_mb"])),
    ]
    if not kvt["checksum"]:
        args.append("--no-verify-kv-digests")
    tls = s.get("kv_tls")
    if tls:
        if not isinstance(tls, dict) or not {"ca", "cert", "key"} <= set(tls):
            raise AgentOpsError("engine_settings.kv_tls: an object with ca, cert and key paths")
        args += ["--kv-tls-ca", tls["ca"], "--kv-tls-cert", tls["cert"], "--kv-tls-key", tls["key"]]
        if target.role == "decode":
            for peer in engine_allowed_peers(config):
                args += ["--kv-allowed-peer", peer]
    elif s.get("kv_insecure"):
        # Plaintext (loopback testbeds only): no certificate, so no allowlist can apply.
        args.append("--kv-insecure")
    else:
        raise AgentOpsError("engine_settings.kv_tls: required (or kv_insecure: true on loopback)")
    if s.get("http_insecure"):
        # Plaintext engine HTTP on a non-loopback bind address: private networks only (the
        # testbed's namespace sites); the reference engine refuses it without the flag.
        args.append("--insecure")
    launch["extra_args"] = args
    return engine, launch


def _vllm_launch(target: Target, config: dict[str, Any], launch: dict[str, Any]) -> dict[str, Any]:
    """Launch settings of a vLLM engine: pdbridge's connector (``kv_transfer.mode`` push, the
    default) configured from the deployment -- the link's deadline, retries, chunk size,
    compression and checksum, the model fingerprint, mTLS and (decode) the listener and its
    allowlist -- or vLLM's NixlConnector for ``pull``. A decode engine's failed KV load
    fails its request (``kv_load_failure_policy: fail``): the gateway then serves it by local
    prefill and says so (``x-pdbridge-path: fallback``) instead of a silent recompute."""
    s = target.settings
    kvt = config["kv_transfer"]
    launch.pop("kv_connector_extra_config", None)
    # Served under the catalog's name: the gateway and verification ask for that model.
    launch["served_model_name"] = target.served_model
    if s.get("max_model_len") is not None:
        launch["max_model_len"] = s["max_model_len"]
    vllm_args = s.get("vllm_args", [])
    if not isinstance(vllm_args, list) or not all(isinstance(a, str) for a in vllm_args):
        raise AgentOpsError(
            f"engine_settings.vllm_args: a list of vllm serve arguments, got {vllm_args!r}"
        )
    if vllm_args:
        launch["extra_args"] = list(vllm_args)
    if target.role == "decode":
        launch["kv_load_failure_policy"] = "fail"
    if kvt.get("mode") == "pull":
        launch["kv_connector"] = "NixlConnector"
        return launch
    extra: dict[str, Any] = {
        "deadline_s": kvt["timeout_ms"] / 1000,
        "link": {
            "timeout_ms": int(kvt["timeout_ms"]),
            "retry": int(kvt["retry"]),
            "chunk_size_bytes": int(float(kvt["chunk_size_mb"]) * (1 << 20)),
            "compression": str(kvt["compression"]),
            "checksum": "xxh3" if kvt["checksum"] else "none",
        },
    }
    if not kvt["checksum"]:
        extra["receiver"] = {"accept_unverified": True}
    model = config["model"]
    if model.get("weights_sha256") and model.get("architecture_hash"):
        extra["fingerprint"] = f"{model['weights_sha256']}:{model['architecture_hash']}"
    if target.role == "decode":
        port = _port(s, "kv_port", DEFAULT_KV_PORT)
        extra["listen"] = str(s.get("kv_listen") or f"{launch['host']}:{port}")
    tls = s.get("kv_tls")
    if tls:
        if not isinstance(tls, dict) or not {"ca", "cert", "key"} <= set(tls):
            raise AgentOpsError("engine_settings.kv_tls: an object with ca, cert and key paths")
        extra.update(tls_ca=tls["ca"], tls_cert=tls["cert"], tls_key=tls["key"])
        if target.role == "decode":
            extra["allowed_peers"] = engine_allowed_peers(config)
    elif s.get("kv_insecure"):
        extra["insecure"] = True
    else:
        raise AgentOpsError("engine_settings.kv_tls: required (or kv_insecure: true on loopback)")
    launch["kv_connector"] = "PdbridgeConnector"
    launch["kv_connector_extra_config"] = extra
    return launch


def allowed_peers(config: dict[str, Any]) -> list[str]:
    """The deployment's resolved KV allowlist (``kv_transfer.allowed_peers``: its prefill
    pools' nodes and ``extra_allowed_peers``). AgentOpsError when missing or malformed."""
    peers = config["kv_transfer"].get("allowed_peers")
    if not isinstance(peers, list) or not all(isinstance(p, str) and p for p in peers):
        raise AgentOpsError(
            "kv_transfer.allowed_peers: a list of certificate names (a config document "
            f"from before allowlists?), got {peers!r}"
        )
    return list(peers)


def engine_allowed_peers(config: dict[str, Any]) -> list[str]:
    """``--kv-allowed-peer`` of a decode engine's KV listener: exactly the deployment's
    allowlist -- only prefill engines push KV into it. An empty allowlist is refused: the
    engine would read "no allowlist" as any certificate of the CA."""
    peers = allowed_peers(config)
    if not peers:
        raise AgentOpsError(
            "kv_transfer.allowed_peers: empty (no prefill node and no extra_allowed_peers): "
            "nobody could send KV, and an empty list would admit any certificate of the CA"
        )
    return peers


def controller_identity() -> str | None:
    """The name the orchestrator's own client certificate carries (its common name), None
    when the controller runs insecure. It dials the kv-link itself (step 5's loopback)."""
    if settings.PDBRIDGE_CONTROLLER_INSECURE:
        return None
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert_file = controller_tls().cert_file
    assert cert_file is not None  # noqa: S101  (controller_tls checked it)
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise AgentOpsError(
            f"PDBRIDGE_CONTROLLER_TLS_CERT: {cert_file} has no common name to allowlist"
        )
    return str(names[0].value)


def kv_link_launch_settings(target: Target, config: dict[str, Any]) -> dict[str, Any]:
    """Launch settings of the kv-link on the decode node ``target``. Its ``allow_peers``: the
    deployment's allowlist (prefill agents probe it in step 2 with their node certificates)
    and the orchestrator's own identity (it sends step 5's loopback transfer) -- nobody
    else. The kv-link runs with the agent's TLS material, so with an insecure controller
    (hence insecure agents, plaintext loopback testbeds) there is no certificate to check and
    no ``allow_peers`` is sent."""
    _, port = target.kv_link_address.rsplit(":", 1)
    launch_settings: dict[str, Any] = {
        "host": str(target.settings.get("host") or "127.0.0.1"),
        "port": int(port),
    }
    identity = controller_identity()
    if identity is not None:
        launch_settings["allow_peers"] = sorted({*allowed_peers(config), identity})
    return launch_settings


def allowlist_evidence(kind: str, launch_settings: dict[str, Any]) -> dict[str, Any] | None:
    """What a step's evidence says about the allowlist of the KV receiver a launch starts
    (None for a child that receives no KV: a prefill engine)."""
    if kind == "kv-link":
        if "allow_peers" in launch_settings:
            return {"applies": True, "peers": list(launch_settings["allow_peers"])}
        return {
            "applies": False,
            "why": "controller insecure: the agents and their kv-link run plaintext, "
            "no certificate to check",
        }
    args = list(launch_settings.get("extra_args") or [])
    if "--kv-listen" not in args:
        return None
    if "--kv-insecure" in args:
        return {"applies": False, "why": "kv_insecure: plaintext KV link, no certificate to check"}
    peers = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--kv-allowed-peer"]
    return {"applies": True, "peers": peers}


def gateway_launch_settings(target: Target) -> dict[str, Any]:
    """Launch settings of the gateway on a decode node: where it listens, and
    ``engine_settings.gateway_settings_file`` (the gateway's settings YAML on that node, e.g.
    its trace sampling) when the pool names one."""
    launch: dict[str, Any] = {
        "host": str(target.settings.get("host") or "127.0.0.1"),
        "port": target.gateway_port,
    }
    if target.settings.get("gateway_settings_file"):
        launch["settings_file"] = str(target.settings["gateway_settings_file"])
    return launch


def gateway_url(target: Target) -> str:
    """Base URL of the gateway on a decode node (HTTPS unless the controller runs insecure):
    ``engine_settings.gateway_host`` when the orchestrator reaches it elsewhere than the node's
    engines (a NAT or load-balancer address in front of it), else the node's host."""
    scheme = "http" if settings.PDBRIDGE_CONTROLLER_INSECURE else "https"
    host = target.settings.get("gateway_host") or target.host
    return f"{scheme}://{host}:{target.gateway_port}"


def child_name(deployment_id: int, part: str) -> str:
    """A deployment's child's name on its agent (``console.deployments.config.child_name``)."""
    from console.deployments.config import child_name as name

    return name(deployment_id, part)


def request_id(ctx: StepContext, target: Target, name: str, body: Any) -> str:
    """Stable per (run, step execution, node, child, settings): a step resumed after its worker
    died repeats the request; an operator's retry (a new execution) sends a new one."""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    return f"run{ctx.run_id}-{ctx.step_name}-{ctx.execution}-{target.hostname}-{name}-{digest[:16]}"


def call(target: Target, fn: Callable[[AgentClient], Awaitable[T]]) -> T:
    """Run ``fn(client)`` against ``target``'s agent (blocking; a private event loop)."""

    async def go() -> T:
        async with AgentClient(target.agent_address, controller_tls(target.hostname)) as agent:
            return await fn(agent)

    return asyncio.run(go())


def launch(
    target: Target,
    *,
    kind: str,
    name: str,
    engine: str = "",
    launch_settings: dict[str, Any] | None = None,
    deployment_id: int = 0,
    config_version: int = 0,
    rid: str,
) -> dict[str, Any]:
    """Launch (or find unchanged) one child; returns the agent's answer as evidence."""

    async def go(agent: AgentClient) -> Any:
        return await agent.launch(
            kind,
            engine=engine,
            settings=launch_settings or {},
            name=name,
            deployment_id=deployment_id,
            config_version=config_version,
            request_id=rid,
        )

    answer = call(target, go)
    child = answer.child
    return {
        "node": target.hostname,
        "site": target.site,
        "name": name,
        "action": answer.action,
        "state": child.state,
        "pid": child.pid,
        "port": child.port,
        "request_id": rid,
    }


def child_status(target: Target, name: str) -> dict[str, Any]:
    """State, pid, restarts and health of one child (``state: absent`` when the agent has
    none)."""

    async def go(agent: AgentClient) -> Any:
        return await agent.status()

    status = call(target, go)
    for child in status.children:
        if child.name == name:
            return {
                "name": name,
                "state": child.state,
                "pid": child.pid,
                "port": child.port,
                "restarts": child.restarts,
                # The agent's own health checks pass (running and answering its health URL).
                "healthy": bool(child.healthy),
            }
    return {"name": name, "state": "absent", "healthy": False}


def probe(target: Target, peer_site: str, address: str, seconds: float) -> dict[str, Any]:
    """The agent on ``target`` measures bandwidth and RTT to a kv-link at ``address``."""

    async def go(agent: AgentClient) -> Any:
        return await agent.probe(peer_site, address, seconds=seconds)

    answer = call(target, go)
    return {
        "from": target.hostname,
        "to": address,
        "mbit_s": round(float(answer.bandwidth_mbit_s), 2),
        "rtt_ms": round(float(answer.rtt_ms), 3),
        "bytes": int(answer.bytes),
        # -1 (unknown) from an agent that cannot read its TCP counters, or an older one (0).
        "tcp_retransmit_ratio": round(float(answer.tcp_retransmit_ratio), 6),
    }


def run_async(coro: Awaitable[T]) -> T:
    """Run a coroutine to completion from synchronous step code."""

    async def go() -> T:
        return await coro

    return asyncio.run(go())
