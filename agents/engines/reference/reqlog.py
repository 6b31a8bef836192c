"""The reference engine's per-request log lines, each naming the request by the caller's
``X-Request-Id`` (the gateway's request id) and the transfer it used, so that one request can be
followed from the gateway through both engines and the KV link (docs/runbook.md, "Reading a
trace"). Called by :mod:`agents.engines.reference.server` on the event loop; never raises.

Lines are ``event key=value ...`` (the engine's log format prints the message only)."""

from __future__ import annotations

import logging
import time
from typing import Any

from agents.engines.reference.transport import ReceivedTransfer, TransferSummary

log = logging.getLogger("pdbridge.engines.server")


def kv_sent(sess: Any, summary: TransferSummary) -> None:
    """A prefill leg's KV reached the decode site's receiver and was confirmed."""
    log.info(
        "kv_sent request_id=%s transfer_id=%s bytes=%d bytes_wire=%s send_s=%.3f",
        sess.req.request_id,
        summary.transfer_id,
        summary.bytes,
        summary.extra.get("bytes_wire", ""),
        summary.seconds,
    )


def kv_imported(sess: Any, transfer_id: str, received: ReceivedTransfer) -> None:
    """A decode leg imported its KV."""
    log.info(
        "kv_imported request_id=%s transfer_id=%s bytes=%d wait_s=%.3f",
        sess.req.request_id,
        transfer_id,
        sum(len(v) for v in received.segments.values()),
        received.wait_seconds,
    )


def request_done(sess: Any) -> None:
    """A request's last token was produced (INFO, one line per request)."""
    kv = sess.req.kv
    log.info(
        "request_done request_id=%s path=%s transfer_id=%s prompt_tokens=%d tokens=%d "
        "queue_s=%.4f prefill_s=%.4f ttft_s=%.4f e2e_s=%.4f",
        sess.req.request_id,
        sess.path,
        kv.transfer_id if kv is not None else "",
        len(sess.prompt_ids),
        len(sess.token_ids),
        sess.timings.get("queue_s", 0.0),
        sess.timings.get("prefill_s", 0.0),
        sess.timings.get("ttft_s", 0.0),
        time.monotonic() - sess.t_arrival,
    )
