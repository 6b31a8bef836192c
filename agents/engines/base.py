"""Engine adapter contract and the lazy registry of adapters (``reference``, ``vllm``).

An adapter turns pdbridge's description of one engine instance (``EngineSpec``: role, model,
port, chunking, KV transfer settings) into a process, and reads that process's health and
metrics. Who calls it: the node agent (start, watch, stop) and tests.

Contract:
* ``command()`` / ``environment()``: pure, deterministic; raise ``AdapterError`` naming the
  field when the spec cannot be expressed for this engine.
* ``start()``: spawns the process and returns at once (blocking only for ``fork``/``exec``);
  a missing executable raises ``AdapterError``.
* ``health()`` / ``ready()`` / ``metrics()``: coroutines with a timeout; never raise for an
  unreachable engine (``False`` / empty dict), since an agent polls them.
* ``stop(grace_s)``: SIGTERM, then SIGKILL after the grace period; blocking; returns the exit
  code.
* ``start_in_process()`` / ``stop_in_process()``: coroutines serving the same spec inside the
  caller's event loop (no process start: tests, the embedded demo). Only engines that can run
  in a Python process offer it (the reference engine); others raise ``AdapterError``.

The registry maps a name to ``module:Class`` and imports on first use, so a node without vLLM
installed never imports it (vLLM's KV connector factory has the same shape).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import aiohttp

# Re-exported for the vLLM adapter's tests, which import it from here; the kv_transfer_params
# convention itself lives in the neutral pdproto (shared with the gateway and the connector).
from pdproto.kv import PULL_PREFILL_KV as PULL_PREFILL_KV

ROLES = ("prefill", "decode", "both")


class AdapterError(Exception):
    """An engine spec cannot be launched by this adapter (the message names the field)."""


@dataclass
class EngineSpec:
    """One engine instance, engine-neutral. Each knob is documented in docs/engines.md."""

    role: str
    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    chunked_prefill_tokens: int = 512
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    #: KV connector: pdbridge's own (``PdbridgeConnector``, push over grpc_kv) or a vLLM
    #: registry name (``NixlConnector``, pull mode, ...).
    kv_connector: str = "PdbridgeConnector"
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    #: ``fail`` (error on a failed KV load) or ``recompute`` (decode prefills locally).
    kv_load_failure_policy: str = "fail"
    engine_id: str | None = None
    #: Host other engines reach this one's KV side channel on (NIXL defaults to localhost).
    kv_side_channel_host: str | None = None
    kv_side_channel_port: int | None = None
    devices: str | None = None
    #: Command prefix that runs the engine (e.g. ``["vllm"]`` or a venv's python -m ...).
    executable: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: The engine's API key (vLLM ``--api-key``): set by the node agent from its environment
    #: (``agents.engines.apikey``), never over the wire; kept out of ``repr``.
    api_key: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        if self.role not in ROLES:
            raise AdapterError(f"role: {self.role!r} is not one of {', '.join(ROLES)}")
        if not self.model:
            raise AdapterError("model: required")
        if not 0 <= self.port <= 65535:
            raise AdapterError("port: must be in 0..65535")
        if self.chunked_prefill_tokens < 1:
            raise AdapterError("chunked_prefill_tokens: must be >= 1")
        if self.tensor_parallel_size < 1:
            raise AdapterError("tensor_parallel_size: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise AdapterError("max_model_len: must be >= 1")
        if self.kv_load_failure_policy not in {"fail", "recompute"}:
            raise AdapterError("kv_load_failure_policy: 'fail' or 'recompute'")

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def parse_prometheus(text: str) -> dict[str, float]:
    """``name{label="v",...}`` -> value for every sample of a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


class EngineAdapter(ABC):
    """Base of engine adapters; see the module docstring for the contract."""

    name: ClassVar[str]

    def __init__(self, spec: EngineSpec) -> None:
        spec.validate()
        self.spec = spec
        self.process: subprocess.Popen[bytes] | None = None

    @abstractmethod
    def command(self) -> list[str]:
        """The argv that starts this engine."""

    def environment(self) -> dict[str, str]:
        """Variables added to (or, with an empty value, removed from) the parent's environment."""
        env = dict(self.spec.env)
        if self.spec.api_key:
            # Both engines read vLLM's variable (an argument would show in ps).
            env.setdefault("VLLM_API_KEY", self.spec.api_key)
        return env

    def start(self, stdout: Any = None, stderr: Any = None) -> None:
        env = dict(os.environ)
        for key, value in self.environment().items():
            if value == "":
                env.pop(key, None)
            else:
                env[key] = value
        try:
            self.process = subprocess.Popen(self.command(), env=env, stdout=stdout, stderr=stderr)  # noqa: S603 - argv built from a validated spec
        except OSError as exc:
            raise AdapterError(f"executable: cannot start {self.command()[0]!r}: {exc}") from exc

    async def _get(self, path: str, timeout_s: float) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(self.spec.base_url + path) as resp,
        ):
            return resp.status, await resp.text()

    async def health(self, timeout_s: float = 2.0) -> bool:
        """True when ``/health`` answers 200 (vLLM: 503 once the engine core died)."""
        try:
            status, _ = await self._get("/health", timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
        return status == 200

    async def ready(self, timeout_s: float = 2.0) -> bool:
        """Healthy and serving the expected model name."""
        try:
            status, text = await self._get("/v1/models", timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
        if status != 200:
            return False
        import json

        try:
            ids = {m.get("id") for m in json.loads(text).get("data", [])}
        except (ValueError, AttributeError):
            return False
        return (self.spec.served_model_name or self.spec.model) in ids

    async def metrics(self, timeout_s: float = 2.0) -> dict[str, float]:
        """Parsed ``/metrics``; empty when unreachable or unparsable."""
        try:
            status, text = await self._get("/metrics", timeout_s)
            return parse_prometheus(text) if status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return {}

    async def wait_ready(self, timeout_s: float, poll_s: float = 0.2) -> bool:
        """Poll ``ready()`` until it holds, the process exits, or the timeout passes."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end:
            if self.process is not None and self.process.poll() is not None:
                return False
            if await self.ready():
                return True
            await asyncio.sleep(poll_s)
        return False

    async def start_in_process(self) -> dict[str, Any]:
        """Serve the spec inside the running event loop; returns the engine's ready line (with
        the bound port, also written to ``spec.port`` when it was 0)."""
        raise AdapterError(f"engine: {self.name} runs only as its own process (use start())")

    async def stop_in_process(self) -> None:
        """Stop what ``start_in_process`` started (in-flight requests end)."""
        return  # an adapter that cannot start in process has nothing to stop

    def stop(self, grace_s: float = 10.0) -> int | None:
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode


_REGISTRY: dict[str, str] = {
    "reference": "agents.engines.reference.adapter:ReferenceAdapter",
    "vllm": "agents.engines.vllm:VllmAdapter",
}


def register_adapter(name: str, target: str) -> None:
    """Add an adapter as ``module:Class`` (imported lazily by ``get_adapter``)."""
    if ":" not in target:
        raise AdapterError(f"adapter target {target!r}: 'module:Class' expected")
    _REGISTRY[name] = target


def adapter_names() -> list[str]:
    return sorted(_REGISTRY)


def get_adapter(name: str) -> type[EngineAdapter]:
    """The adapter class registered under ``name``; imports its module now."""
    try:
        module_name, _, class_name = _REGISTRY[name].partition(":")
    except KeyError:
        raise AdapterError(
            f"engine: unknown adapter {name!r}; known: {', '.join(adapter_names())}"
        ) from None
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, EngineAdapter)):
        raise AdapterError(f"engine: {_REGISTRY[name]} is not an EngineAdapter")
    return cls
