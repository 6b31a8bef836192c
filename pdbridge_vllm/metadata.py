"""What the connector's scheduler side tells its workers each step (vLLM pickles it from the
engine core to the worker processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

BlockIds = tuple[list[int], ...]


@dataclass
class SaveStep:
    """Prefill side, one step: the request's blocks and how many tokens are computed after it."""

    req_id: str
    transfer_id: str
    destination: str
    request_id: str
    n_tokens: int
    computed: int
    block_ids: BlockIds
    fault: str | None = None


@dataclass
class SaveEnd:
    """Prefill side: the request finished (``ok``) or was aborted; its final blocks."""

    req_id: str
    ok: bool
    block_ids: BlockIds


@dataclass
class LoadStart:
    """Decode side: wait for ``transfer_id`` and fill these blocks."""

    req_id: str
    transfer_id: str
    deadline_s: float
    n_tokens: int
    local_tokens: int
    block_ids: BlockIds
    #: The gateway's request id (``kv_transfer_params.request_id``), else vLLM's own: named in
    #: the load's log lines.
    request_id: str = ""


@dataclass
class PdbridgeMetadata(KVConnectorMetadata):
    saves: list[SaveStep] = field(default_factory=list)
    ends: list[SaveEnd] = field(default_factory=list)
    loads: list[LoadStart] = field(default_factory=list)
    cancel_loads: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
