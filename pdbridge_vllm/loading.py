"""The decode rank's side of the connector, in the worker: each request's load, from the
parts of its shard the prefill ranks send to where they go in this rank's blocks."""

from __future__ import annotations

from collections.abc import Callable

from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

from grpc_kv import api as kv
from pdbridge_vllm.layout import LAYOUT_ATTR
from pdbridge_vllm.metadata import LoadStart
from pdbridge_vllm.pages import PageWriter
from pdbridge_vllm.runtime import LayoutRefused, Worker
from pdbridge_vllm.transfers import Incoming


class Loader:
    """One decode worker's incoming loads. Called from the model-runner thread; the loads
    run on the runtime's loop, which also writes the pages."""

    def __init__(self, worker: Worker) -> None:
        self._runtime = worker.runtime
        self._layout = worker.layout
        self._caches = worker.caches
        self._fingerprint = worker.fingerprint
        self._spec_blocks = worker.spec_blocks
        self._in: dict[str, Incoming] = {}

    def start(self, load: LoadStart) -> None:
        layout = self._layout
        block_ids = tuple(
            clip_ssm_state_blocks(list(ids), self._spec_blocks[g])
            if g < len(layout.groups) and layout.groups[g].kind == "state"
            else list(ids)
            for g, ids in enumerate(load.block_ids)
        )

        def writer(header: kv.TransferHeader) -> Callable[[kv.Segment], None]:
            src_rank, src_tp = layout.source(header.attrs.get(LAYOUT_ATTR))
            plan = layout.plan_from(src_rank, src_tp)
            expected = [(s.name, s.length) for s in layout.manifest(load.n_tokens, plan)]
            declared = [(s.name, s.length) for s in header.layers]
            if declared != expected:
                raise LayoutRefused(
                    f"header: part {header.transfer_id} from prefill rank {src_rank} of "
                    f"{src_tp} declares {len(declared)} layers / {sum(n for _, n in declared)} "
                    f"bytes, this rank expects {len(expected)} / {sum(n for _, n in expected)}"
                )
            return PageWriter(
                layout, self._caches, block_ids, load.n_tokens, load.local_tokens, plan
            ).write

        self._in[load.req_id] = Incoming(
            self._runtime,
            load.transfer_id,
            load.deadline_s,
            self._fingerprint,
            layout,
            load.n_tokens,
            writer,
            request_id=load.request_id or load.req_id,
        )

    def cancel(self, req_id: str) -> None:
        incoming = self._in.get(req_id)
        if incoming is not None:
            incoming.cancel()

    def finished(self) -> tuple[set[str], set[str]]:
        """(ended, failed) loads since the last call: vLLM schedules the first, and
        recomputes or fails the second by ``kv_load_failure_policy``."""
        ended, failed = set(), set()
        for req_id, incoming in list(self._in.items()):
            if incoming.done.is_set():
                del self._in[req_id]
                ended.add(req_id)
                if incoming.error is not None:
                    failed.add(req_id)
        return ended, failed
