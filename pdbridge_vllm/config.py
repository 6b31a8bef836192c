"""The connector's knobs: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``
(docs/vllm.md lists each). Parsed once per process; a bad value stops vLLM at start with a
message naming the key, never at the first request."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from grpc_kv import api as kv

KEYS = (
    "listen",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "insecure",
    "allowed_peers",
    "fingerprint",
    "deadline_s",
    "lease_s",
    "link",
    "receiver",
    "faults",
    "link_cpus",
    "idle_poll_ms",
    "worker_spin_ms",
    "layerwise",
)
#: Per-request faults honoured when ``faults`` is on (``kv_transfer_params.pdbridge_fault`` of
#: a prefill leg): what the verification tests and drills use to prove a damaged transfer is
#: caught. ``zero_layer``: the first attention layer's pages sent as zeros; ``zero_state``: the
#: first recurrent-state page sent as zeros; ``fingerprint``: the header names another model.
#: Tensor parallelism: ``shard_missing``: the last prefill rank never sends the last decode
#: rank its part; ``shard_wrong_rank``: each decode rank gets the heads cut for another (at
#: decode TP > 1), or a prefill rank's part names another rank (at decode TP 1).
FAULTS = ("zero_layer", "zero_state", "fingerprint", "shard_missing", "shard_wrong_rank")


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` key is missing or wrong; the message names it."""


@dataclass(frozen=True)
class ConnectorConfig:
    #: decode role: where the embedded KV receiver listens (``host:port``; port 0 = any).
    listen: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Plaintext link: development only, refused unless set explicitly.
    insecure: bool = False
    #: Certificate names allowed to connect (decode role) besides the CA check.
    allowed_peers: tuple[str, ...] = ()
    #: ``weights_sha256:arch_hash`` of the served model (the console's model fingerprint);
    #: computed from the model directory when unset.
    fingerprint: str | None = None
    #: How long a decode request waits for its KV when the request names no ``deadline_s``.
    deadline_s: float = 15.0
    #: Longest a prefill holds a finished request's blocks for its transfer.
    lease_s: float = 60.0
    link: kv.LinkOptions = field(default_factory=kv.LinkOptions)
    receiver: kv.ReceiverOptions = field(default_factory=kv.ReceiverOptions)
    #: Honour ``pdbridge_fault`` in requests (tests and drills only; off in production).
    faults: bool = False
    #: CPUs the link's threads may run on. Unset: every CPU the process's cgroup allows --
    #: not the core vLLM's CPU backend binds its worker to (``VLLM_CPU_OMP_THREADS_BIND``),
    #: which the link's threads would otherwise inherit and share with the forward pass.
    link_cpus: tuple[int, ...] | None = None
    #: With nothing to compute and only transfers to wait for, the engine core waits this
    #: long at most for a worker to say one ended, instead of stepping every millisecond
    #: (pdbridge_vllm.idle). 0: vLLM's own stepping.
    idle_poll_ms: float = 100.0
    #: A worker's shared-memory readers spin this long after a message, then sleep (vLLM:
    #: 1000). None: vLLM's own.
    worker_spin_ms: float | None = 1.0
    #: Prefill: queue each attention layer's pages of a step right after that layer's
    #: forward (vLLM's save_kv_layer), not after the whole step.
    layerwise: bool = True

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(KEYS)}"
            )
        env = os.environ
        values: dict[str, Any] = {
            "listen": extra.get("listen"),
            "tls_ca": extra.get("tls_ca") or env.get("PDBRIDGE_KV_TLS_CA"),
            "tls_cert": extra.get("tls_cert") or env.get("PDBRIDGE_KV_TLS_CERT"),
            "tls_key": extra.get("tls_key") or env.get("PDBRIDGE_KV_TLS_KEY"),
            "insecure": _bool(extra.get("insecure", False), "insecure"),
            "allowed_peers": tuple(_strings(extra.get("allowed_peers", ()), "allowed_peers")),
            "fingerprint": extra.get("fingerprint"),
            "deadline_s": _positive(extra.get("deadline_s", 15.0), "deadline_s"),
            "lease_s": _positive(extra.get("lease_s", 60.0), "lease_s"),
            "link": _options(kv.LinkOptions, extra.get("link", {}), "link"),
            "receiver": _options(kv.ReceiverOptions, extra.get("receiver", {}), "receiver"),
            "faults": _bool(extra.get("faults", False), "faults"),
            "link_cpus": _cpus(extra.get("link_cpus")),
            "layerwise": _bool(extra.get("layerwise", True), "layerwise"),
            "idle_poll_ms": _non_negative(extra.get("idle_poll_ms", 100.0), "idle_poll_ms"),
            "worker_spin_ms": None
            if extra.get("worker_spin_ms", 1.0) is None
            else _non_negative(extra.get("worker_spin_ms", 1.0), "worker_spin_ms"),
        }
        if values["fingerprint"] is not None and ":" not in str(values["fingerprint"]):
            raise ConfigError("kv_connector_extra_config.fingerprint: 'weights_sha256:arch_hash'")
        if not values["insecure"] and not (
            values["tls_ca"] and values["tls_cert"] and values["tls_key"]
        ):
            raise ConfigError(
                "kv_connector_extra_config.tls_ca/tls_cert/tls_key (or PDBRIDGE_KV_TLS_CA/"
                "_CERT/_KEY): required for the KV link unless insecure is true"
            )
        return cls(**values)

    def tls(self) -> kv.TLSConfig:
        if self.insecure:
            return kv.TLSConfig.development()
        return kv.TLSConfig(
            ca_file=self.tls_ca,  # type: ignore[arg-type]
            cert_file=self.tls_cert,  # type: ignore[arg-type]
            key_file=self.tls_key,  # type: ignore[arg-type]
            allowed_peers=list(self.allowed_peers) or None,
        )


def model_fingerprint(model_dir: str) -> kv.Fingerprint:
    """``sha256`` of the weight files (sorted by name) and of the canonical ``config.json``:
    what pdbridge's console records as a model's fingerprint. Reads every weight byte, so
    production sets ``fingerprint`` instead."""
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        raise ConfigError(
            f"kv_connector_extra_config.fingerprint: unset, and {model_dir!r} is no local "
            "model directory to compute it from"
        )
    weights = hashlib.sha256()
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        with path.open("rb") as f:
            while block := f.read(1 << 24):
                weights.update(block)
    config = json.loads((root / "config.json").read_text())
    arch = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return kv.Fingerprint(weights_sha256=weights.hexdigest(), arch_hash=arch)


def parse_fingerprint(text: str) -> kv.Fingerprint:
    weights, _, arch = text.partition(":")
    return kv.Fingerprint(weights_sha256=weights, arch_hash=arch)


def _options(kind: Any, value: Any, key: str) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(f"kv_connector_extra_config.{key}: an object expected")
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config.{key}: unknown key(s) {', '.join(unknown)}")
    try:
        return kind(**value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"kv_connector_extra_config.{key}.{exc}") from exc


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key}: true or false expected")
    return value


def _positive(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config.{key}: a positive number expected")
    return float(value)


def _non_negative(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"kv_connector_extra_config.{key}: a number >= 0 expected")
    return float(value)


def _cpus(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise ConfigError(
            "kv_connector_extra_config.link_cpus: a non-empty list of CPU numbers expected"
        )
    return tuple(value)


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"kv_connector_extra_config.{key}: a list of strings expected")
    return list(value)
