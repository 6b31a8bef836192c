"""The prefill rank's side of the connector, in the worker: when each request's transfer
opens, which pages go after each step, and when it is finished.

The link works while prefill computes: a request's transfer opens (the decode engine's
ranks looked up, Begin sent) when the scheduler first schedules it, *before* that step's
forward pass; after every step the pages it completed are copied out and queued; the step
that completes the prompt also queues the partial last block and the linear-attention state
slots and finishes the transfer at once, without waiting for the next engine step. The
blocks stay held by vLLM (``request_finished_all_groups`` -> delay-free) until every part is
acknowledged or failed.
"""

from __future__ import annotations

import logging

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

from grpc_kv import api as kv
from pdbridge_vllm.layout import LayerPages
from pdbridge_vllm.metadata import BlockIds, SaveEnd, SaveStep
from pdbridge_vllm.pages import NULL_BLOCK, Cutter, copy_pages
from pdbridge_vllm.runtime import Worker
from pdbridge_vllm.transfers import Outgoing, Request

log = logging.getLogger("vllm.pdbridge")


class Sender:
    """One prefill worker's outgoing transfers (see the module docstring). Called from the
    model-runner thread only; the transfers themselves run on the runtime's loop."""

    def __init__(self, worker: Worker) -> None:
        self._runtime = worker.runtime
        self._layout = worker.layout
        self._caches = worker.caches
        self._fingerprint = worker.fingerprint
        self._spec_blocks = worker.spec_blocks
        self._cut = Cutter(worker.layout)
        self._out: dict[str, Outgoing] = {}
        self._next: dict[tuple[str, str], int] = {}
        self._faults: dict[str, str] = {}
        # Finished requests whose transfer is still in flight (vLLM holds their blocks).
        self._ended: dict[str, Outgoing] = {}
        # Requests whose blocks the scheduler holds (request_finished answered True) but that
        # have no transfer to wait for (it never opened): reported finished at the next poll.
        self._released: set[str] = set()

    def open(self, step: SaveStep) -> None:
        """Open ``step``'s transfer if it is not open yet: called before the step's forward
        pass, so the decode engine is looked up and Begin travels while it computes."""
        if step.req_id in self._out:
            return
        fingerprint = self._fingerprint
        if step.fault == "fingerprint":
            fingerprint = kv.Fingerprint("0" * 64, fingerprint.arch_hash)
        request = Request(
            transfer_id=step.transfer_id,
            request_id=step.request_id,
            fingerprint=fingerprint,
            n_tokens=step.n_tokens,
            fault=step.fault if step.fault in ("shard_missing", "shard_wrong_rank") else None,
        )
        try:
            self._layout.manifest(step.n_tokens)
        except ValueError as exc:
            log.warning("pdbridge_kv_params_invalid request_id=%s: %s", step.req_id, exc)
            return
        log.debug(
            "pdbridge_kv_open req=%s n=%d computed=%d", step.req_id, step.n_tokens, step.computed
        )
        self._out[step.req_id] = Outgoing(
            self._runtime, step.destination, request, self._layout, self._cut
        )
        if step.fault is not None:
            self._faults[step.req_id] = step.fault
        for pages in self._layout.tensors().values():
            self._next[(step.req_id, pages.name)] = -1

    def saved(self, step: SaveStep) -> None:
        """After ``step``'s forward pass: queue the pages it completed; when it completed
        the prompt, the rest (last partial block, state slots) and finish."""
        out = self._out.get(step.req_id)
        if out is None or (out.done.is_set() and out.error is not None):
            return
        done = step.computed >= step.n_tokens
        self._send_attention(out, step.req_id, step.block_ids, step.computed, step.n_tokens)
        if done and not out.finished:
            self._send_states(out, step.req_id, step.block_ids)
            out.finish()

    def end(self, end: SaveEnd) -> None:
        """The scheduler freed the request (finished, or aborted: ``end.ok`` false)."""
        out = self._out.pop(end.req_id, None)
        log.debug("pdbridge_kv_end req=%s ok=%s out=%s", end.req_id, end.ok, out is not None)
        if out is None:
            if end.ok:
                self._released.add(end.req_id)
        elif not end.ok:
            out.cancel("the request was aborted")
            # The scheduler freed the aborted request's blocks already (request_finished
            # answered False); reporting it in finished_sending would name a request vLLM no
            # longer knows (its scheduler asserts on that and the EngineCore dies).
        else:
            if not out.finished:  # a prompt whose last step this worker did not see
                n = out.request.n_tokens
                self._send_attention(out, end.req_id, end.block_ids, n, n)
                self._send_states(out, end.req_id, end.block_ids)
                out.finish()
            self._ended[end.req_id] = out
        for key in [k for k in self._next if k[0] == end.req_id]:
            del self._next[key]
        self._faults.pop(end.req_id, None)

    def expire(self, req_id: str, lease_s: float) -> None:
        out = self._ended.get(req_id)
        if out is not None:
            out.cancel(f"lease of {lease_s:g} s passed")

    def finished(self) -> set[str]:
        """Requests whose every part ended (acknowledged or failed): vLLM frees their blocks."""
        done = set(self._released)
        self._released.clear()
        for req_id, out in list(self._ended.items()):
            if out.done.is_set():
                del self._ended[req_id]
                done.add(req_id)
        return done

    # ---------------------------------------------------------------------------------

    def layer_saved(self, layer: str, steps: list[SaveStep]) -> None:
        """Right after attention layer ``layer``'s forward in this step (vLLM's
        ``save_kv_layer``): queue that layer's pages the step completed, so they travel while
        the step's later layers compute (with a one-step prompt, the whole transfer would
        otherwise wait for the whole forward pass)."""
        g = self._layout.group_of(layer)
        if g is None or self._layout.groups[g].kind == "state":
            return
        group = self._layout.groups[g]
        for step in steps:
            out = self._out.get(step.req_id)
            if out is None or out.done.is_set():
                continue
            for pages in group.layers:
                if pages.layer == layer:
                    self._send_pages(out, step, g, pages)

    def _send_attention(
        self, out: Outgoing, req_id: str, block_ids: BlockIds, computed: int, n_tokens: int
    ) -> None:
        """Queue, group by group, the pages of positions computed and not yet sent (those
        ``layer_saved`` did not send already)."""
        step = SaveStep(req_id, "", "", "", n_tokens, computed, block_ids)
        for g, group in enumerate(self._layout.groups):
            if group.kind == "state":
                continue
            for pages in group.layers:
                if not self._send_pages(out, step, g, pages):
                    return

    def _send_pages(self, out: Outgoing, step: SaveStep, g: int, pages: LayerPages) -> bool:
        """Queue ``pages``' positions that ``step`` completed and that are not sent yet;
        False when the request's blocks are not all held (the transfer is cancelled)."""
        group = self._layout.groups[g]
        positions = group.positions(step.n_tokens)
        ready = min(group.ready_until(step.computed, step.n_tokens), positions.stop)
        key = (step.req_id, pages.name)
        start = max(self._next.get(key, -1), positions.start)
        if start >= ready:
            return True
        ids = step.block_ids[g][start:ready]
        if len(ids) != ready - start or NULL_BLOCK in ids:
            out.cancel(f"blocks {start}..{ready} of {pages.name} are not held")
            return False
        data = copy_pages(self._caches[pages.layer][pages.tensor], ids)
        if self._faults.get(step.req_id) == "zero_layer" and (
            pages is self._layout.first_attention()
        ):
            data = torch.zeros_like(data)
        out.send(pages.name, data, final=ready == positions.stop)
        self._next[key] = ready
        return True

    def _send_states(self, out: Outgoing, req_id: str, block_ids: BlockIds) -> None:
        """Queue every linear-attention layer's state slot (the running slot of its group)."""
        first = True  # the zero_state fault zeroes the first recurrent state
        for g, group in enumerate(self._layout.groups):
            if group.kind != "state":
                continue
            ids = list(block_ids[g]) if g < len(block_ids) else []
            slot = clip_ssm_state_blocks(ids, self._spec_blocks[g])
            if not slot or slot[0] == NULL_BLOCK:
                out.cancel(f"no state slot for group {g}")
                return
            for pages in group.layers:
                data = copy_pages(self._caches[pages.layer][pages.tensor], slot)
                if pages.kind is kv.LayerKind.LINEAR_STATE and first:
                    first = False
                    if self._faults.get(req_id) == "zero_state":
                        data = torch.zeros_like(data)
                out.send(pages.name, data, final=True)
