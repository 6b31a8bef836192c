"""pdbridge's vLLM KV connector: push mode over grpc_kv, hybrid-aware (``SupportsHMA``).

Load it with ``--kv-transfer-config '{"kv_connector": "PdbridgeConnector",
"kv_connector_module_path": "pdbridge_vllm.connector", "kv_role": "kv_producer" | "kv_consumer",
"kv_connector_extra_config": {...}}'`` (docs/vllm.md). One class serves both roles and both of
vLLM's sides of a role: vLLM builds it in the scheduler (engine core) and in every worker.

Requests carry pdbridge's ``kv_transfer_params`` (the gateway's push mode):

* prefill leg ``{"do_remote_decode": true, "transfer_id", "kv_destination": "host:port"}``: the
  scheduler side tells the worker, step by step, which of the request's blocks are computed;
  after each step's forward pass (``wait_for_save``) the worker hands the blocks computed in
  that step to a grpc_kv transfer (the link sends them while the next step computes), and once
  the request finishes, the linear-attention state slots and the rest, then finishes the
  transfer. The blocks are held until the transfer is acknowledged or failed
  (``request_finished_all_groups`` -> ``get_transfer_results().finished_sending``), at most
  ``lease_s``. Models with linear attention prefill N-1 tokens: decode computes the last one
  on top of state h(N-1) (applying it twice would corrupt the recurrent state).
* decode leg ``{"do_remote_prefill": true, "transfer_id", "deadline_s"}``: the scheduler side
  answers the prompt (less the backoff) as loadable asynchronously; the worker waits for the
  transfer on its embedded receiver (fingerprint checked at Begin, layout before any block is
  written), writes every verified page into the request's blocks as it arrives, and reports
  the request finished -- or failed (``failed_recving``), so vLLM recomputes locally
  (``kv_load_failure_policy: recompute``) or fails the request (``fail``) -- within the
  deadline. vLLM never times out a waiting request itself; this connector always does.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks, yield_req_data
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MambaSpec

from pdbridge_vllm import idle, topology
from pdbridge_vllm import stats as connector_stats
from pdbridge_vllm.config import (
    FAULTS,
    ConfigError,
    ConnectorConfig,
    model_fingerprint,
    parse_fingerprint,
)
from pdbridge_vllm.layout import KvLayout
from pdbridge_vllm.loading import Loader
from pdbridge_vllm.metadata import LoadStart, PdbridgeMetadata, SaveEnd, SaveStep
from pdbridge_vllm.pages import request_amx_permission
from pdbridge_vllm.runtime import PEER_ATTR, Runtime, Worker
from pdbridge_vllm.sending import Sender
from pdproto.http import clip_request_id
from pdproto.kv import (
    DEADLINE_S,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    KV_DESTINATION,
    REQUEST_ID,
    TRANSFER_ID,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.pdbridge")  # under vLLM's logger: its handler and format
BlockIds = tuple[list[int], ...]


def _route_link_logs() -> None:
    """The KV link's own lines (``grpc_kv``: retries, resumes, refusals at INFO) through
    vLLM's handler and format, beside the connector's: without this only its warnings
    reached the log, in Python's bare default format, and a slow transfer said nothing."""
    link, engine = logging.getLogger("grpc_kv"), logging.getLogger("vllm")
    if link.handlers or not engine.handlers:
        return
    for handler in engine.handlers:
        link.addHandler(handler)
    link.setLevel(logging.INFO)
    link.propagate = False


_route_link_logs()


class PdbridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        topology.check_parallelism(vllm_config)
        self._producer = bool(self._kv_transfer_config.is_kv_producer)
        self._consumer = bool(self._kv_transfer_config.is_kv_consumer)
        self._group_ids = tuple(kv_cache_config.transfer_group_ids)
        groups = [kv_cache_config.kv_cache_groups[g] for g in self._group_ids]
        self._state_groups = [isinstance(g.kv_cache_spec, MambaSpec) for g in groups]
        self._spec_blocks = [getattr(g.kv_cache_spec, "num_speculative_blocks", 0) for g in groups]
        # A model with linear layers prefills N-1 tokens (see the module docstring).
        self._backoff = 1 if kv_cache_config.has_mamba_layers else 0
        self._model = vllm_config.model_config.model
        # Scheduler side
        self._sending: dict[str, Request] = {}
        self._held: dict[str, float] = {}
        self._pending = PdbridgeMetadata()
        self._loading: dict[str, LoadStart] = {}
        self._local: dict[str, int] = {}
        self._doorbell = (
            idle.Doorbell()
            if role == KVConnectorRole.SCHEDULER and self.config.idle_poll_ms > 0
            else None
        )
        # Worker side
        self._runtime: Runtime | None = None
        self._layout: KvLayout | None = None
        self._sender: Sender | None = None
        self._loader: Loader | None = None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Head-major pages (``[heads, block, 2 * head dim]`` per block): a decode rank's
        heads are one contiguous run of a prefill rank's page, as vLLM's NIXL connector
        asks for the same reason (the CPU backend has no other layout)."""
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not (self._producer and params and params.get(DO_REMOTE_DECODE)):
            return
        if not (params.get(TRANSFER_ID) and params.get(KV_DESTINATION)):
            log.warning(
                "pdbridge_kv_params_incomplete request_id=%s: do_remote_decode without "
                "transfer_id and kv_destination; no KV is sent",
                request.request_id,
            )
            return
        backoff = self._backoff
        if backoff and request.num_prompt_tokens > backoff and not params.get("_pdbridge_cut"):
            # Stop short of what decode recomputes (vLLM's NIXL connector does the same).
            if request.prompt_token_ids is not None:
                del request.prompt_token_ids[-backoff:]
            del request._all_token_ids[-backoff:]
            request.num_prompt_tokens -= backoff
            request.max_tokens = 1
            params["_pdbridge_cut"] = True
        self._sending[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self._consumer and params and params.get(DO_REMOTE_PREFILL)):
            return 0, False
        if not params.get(TRANSFER_ID) or params.get("_pdbridge_staged"):
            return 0, False
        count = self._remote_tokens(len(request.prompt_token_ids or ())) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local[request.request_id] = num_computed_tokens  # this engine's prefix-cache hit
        return count, True

    def _remote_tokens(self, prompt_tokens: int) -> int:
        return prompt_tokens - self._backoff if prompt_tokens > self._backoff else prompt_tokens

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._group_ids  # a transfer restores every group, not only prefix-cacheable ones

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not (self._consumer and params and params.get(DO_REMOTE_PREFILL)):
            return
        if num_external_tokens <= 0 or params.get("_pdbridge_staged"):
            return
        block_ids = self._select(self._manager().get_block_ids(request.request_id))
        local = self._local.pop(request.request_id, 0)
        deadline = params.get(DEADLINE_S)
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline <= 0:
            deadline = self.config.deadline_s
        start = LoadStart(
            req_id=request.request_id,
            transfer_id=str(params[TRANSFER_ID]),
            deadline_s=float(deadline),
            n_tokens=local + num_external_tokens,
            local_tokens=local,
            block_ids=block_ids,
            # vLLM's request id derives from X-Request-Id but carries prefixes and suffixes
            # of its own; the gateway's id rides in kv_transfer_params.
            request_id=clip_request_id(str(params.get(REQUEST_ID) or request.request_id)),
        )
        self._pending.loads.append(start)
        self._loading[request.request_id] = start
        params["_pdbridge_staged"] = True

    def _fault(self, params: dict[str, Any]) -> str | None:
        fault = params.get("pdbridge_fault")
        if fault is None or not self.config.faults:
            return None
        if fault not in FAULTS:
            log.warning("pdbridge_kv_fault_unknown fault=%r known=%s", fault, ",".join(FAULTS))
            return None
        return str(fault)

    def _meta(self) -> PdbridgeMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PdbridgeMetadata):
            raise TypeError(f"connector metadata: {type(meta).__name__}, not PdbridgeMetadata")
        return meta

    def _manager(self) -> Any:
        if self._kv_cache_manager is None:
            raise RuntimeError("the KV cache manager is not bound to the connector yet")
        return self._kv_cache_manager

    def _select(self, block_ids: Any) -> BlockIds:
        ids = self._kv_cache_config.select_transfer_block_ids(block_ids)
        return tuple(list(group) for group in ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._idle(scheduler_output)
        meta, self._pending = self._pending, PdbridgeMetadata()
        if self._sending:
            manager = self._manager()
            for req_id, _, _ in yield_req_data(scheduler_output):
                request = self._sending.get(req_id)
                if request is None:
                    continue
                params = request.kv_transfer_params or {}
                meta.saves.append(
                    SaveStep(
                        req_id=req_id,
                        transfer_id=str(params[TRANSFER_ID]),
                        destination=str(params[KV_DESTINATION]),
                        request_id=clip_request_id(str(params.get(REQUEST_ID) or req_id)),
                        n_tokens=request.num_prompt_tokens,
                        computed=request.num_computed_tokens
                        + scheduler_output.num_scheduled_tokens.get(req_id, 0),
                        block_ids=self._select(manager.get_block_ids(req_id)),
                        fault=self._fault(params),
                    )
                )
        now = time.monotonic()
        for req_id, until in list(self._held.items()):
            if until < now:
                meta.expired.append(req_id)
                self._held[req_id] = float("inf")  # reported once; freed when the worker says so
        return meta

    def _idle(self, scheduler_output: SchedulerOutput) -> None:
        """A step with nothing to compute while transfers are only awaited: wait for a
        worker's doorbell (a load or send ended) or ``idle_poll_ms``, rather than step every
        millisecond with every worker spinning (pdbridge_vllm.idle)."""
        if self._doorbell is None or scheduler_output.total_num_scheduled_tokens:
            return
        pending = self._pending
        if pending.loads or pending.cancel_loads or pending.ends or pending.saves:
            return
        if self._loading or self._held:
            self._doorbell.wait(self.config.idle_poll_ms / 1000)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._local.pop(req_id, None)
        if req_id in self._loading:
            load = self._loading.pop(req_id)
            if request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED,
                RequestStatus.FINISHED_STOPPED,
            ):
                # Aborted while its KV may still be arriving: vLLM frees the blocks once the
                # load is reported finished; end it now rather than at the deadline.
                self._pending.cancel_loads.append(load.req_id)
            return False, None
        sending = self._sending.pop(req_id, None)
        if sending is None:
            return False, None
        params = request.kv_transfer_params or {}
        ok = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        ids = self._select(block_ids)
        final = tuple(
            clip_ssm_state_blocks(list(group), self._spec_blocks[i])
            if self._state_groups[i]
            else list(group)
            for i, group in enumerate(ids)
        )
        self._pending.ends.append(SaveEnd(req_id=req_id, ok=ok, block_ids=final))
        if not ok:
            return False, None
        self._held[req_id] = time.monotonic() + self.config.lease_s
        return True, {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            TRANSFER_ID: params.get(TRANSFER_ID),
            KV_DESTINATION: params.get(KV_DESTINATION),
            "kv_connector": "pdbridge",
            "kv_tokens": request.num_prompt_tokens,
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_sending or ():
            self._held.pop(req_id, None)

    def has_pending_push_work(self) -> bool:
        # Keep vLLM stepping while transfers hold blocks, so their completion is polled.
        return bool(self._held)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        caches = {
            name: list(t) if isinstance(t, (list, tuple)) else [t] for name, t in kv_caches.items()
        }
        request_amx_permission(caches)
        layout = self._layout = topology.build(self._vllm_config, self._kv_cache_config, caches)
        fingerprint = (
            parse_fingerprint(self.config.fingerprint)
            if self.config.fingerprint
            else model_fingerprint(self._model)
        )
        runtime = self._runtime = Runtime(
            self.config.link, self.config.tls(), self.config.link_cpus
        )
        if self.config.idle_poll_ms > 0:
            runtime.on_end = idle.Bell().ring
        if self.config.worker_spin_ms is not None:
            idle.quiet_spinning(self.config.worker_spin_ms / 1000)
        worker = Worker(runtime, layout, caches, fingerprint, self._spec_blocks)
        if self._producer:
            self._sender = Sender(worker)
        if self._consumer:
            self._loader = Loader(worker)
            port = runtime.listen(self._listen(layout), self.config.receiver)
            if runtime.receiver is not None:
                runtime.receiver.describe[PEER_ATTR] = json.dumps(
                    {"tp": layout.tp, "rank": layout.rank}
                )
            log.info(
                "pdbridge_kv_listening address=%s port=%d rank=%d/%d",
                self.config.listen,
                port,
                layout.rank,
                layout.tp,
            )
        log.info(
            "pdbridge_kv_ready role=%s rank=%d/%d groups=%s fingerprint=%s",
            "producer" if self._producer else "consumer",
            layout.rank,
            layout.tp,
            [(g.kind, g.block_size, [p.page_shape for p in g.layers[:1]]) for g in layout.groups],
            fingerprint,
        )

    def _listen(self, layout: KvLayout) -> str:
        """Where this decode rank's receiver listens: ``listen``'s port + the TP rank (the
        prefill ranks reach rank r there, having asked rank 0 of the engine's size)."""
        if not self.config.listen:
            raise ConfigError("kv_connector_extra_config.listen: required for kv_consumer")
        if layout.tp == 1:
            return self.config.listen
        host, _, port = self.config.listen.rpartition(":")
        if not port.isdigit() or int(port) == 0:
            raise ConfigError(
                f"kv_connector_extra_config.listen: {self.config.listen!r}: tensor parallel "
                f"{layout.tp} needs a fixed port (rank r listens on port + r)"
            )
        return f"{host}:{int(port) + layout.rank}"

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Before the step's forward pass: start this step's loads, end what the scheduler
        ended, and open the transfers of newly scheduled prefill requests (Begin travels
        while the step computes)."""
        if not self.has_connector_metadata():
            return
        meta = self._meta()
        if self._loader is not None:
            for load in meta.loads:
                self._loader.start(load)
            for req_id in meta.cancel_loads:
                self._loader.cancel(req_id)
        if self._sender is not None:
            for end in meta.ends:
                self._sender.end(end)
            for req_id in meta.expired:
                self._sender.expire(req_id, self.config.lease_s)
            for step in meta.saves:
                self._sender.open(step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before vLLM schedules the request (asynchronous loading)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """After one attention layer's forward: its pages of this step go at once, while the
        later layers compute (``layerwise``; the rest, and linear-attention state, after
        the forward in :meth:`wait_for_save`)."""
        if not self.config.layerwise or self._sender is None or not self.has_connector_metadata():
            return
        saves = self._meta().saves
        if saves:
            self._sender.layer_saved(layer_name, saves)

    def wait_for_save(self) -> None:
        """Queue every prefill request's pages computed in this step; the link sends them
        from its own thread while vLLM runs the next step (the next chunk of a long prompt).
        The step that completes a prompt finishes its transfer."""
        if not self.has_connector_metadata() or self._sender is None:
            return
        for step in self._meta().saves:
            self._sender.saved(step)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self._sender is not None:
            results.finished_sending.update(self._sender.finished())
        if self._loader is not None:
            ended, failed = self._loader.finished()
            results.finished_recving.update(ended)
            results.failed_recving.update(failed)
        return results

    def get_kv_connector_stats(self) -> Any:
        if self._runtime is None:
            return None
        stats = self._runtime.take_stats()
        return None if stats is None else connector_stats.PdbridgeStats(data=stats.as_dict())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return (
            connector_stats.PdbridgeStats(data=data)
            if data is not None
            else connector_stats.PdbridgeStats()
        )

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> Any:
        return connector_stats.PdbridgePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        if self._doorbell is not None:
            self._doorbell.close()
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
