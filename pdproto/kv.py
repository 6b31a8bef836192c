"""The ``kv_transfer_params`` convention (vLLM's field names) and the KV error codes.

A request carries ``kv_transfer_params``; the gateway sets them, the engine (reference engine
or vLLM with pdbridge's connector) acts on them:

* prefill leg: ``do_remote_decode`` + ``transfer_id`` + ``kv_destination`` (push mode);
* decode leg: ``do_remote_prefill`` + ``transfer_id`` (+ ``deadline_s``, ``fallback``).

An engine whose KV leg failed answers 503 with an OpenAI-shaped error of type
:data:`KV_ERROR_TYPE` whose ``code`` is one of the ``KV_*`` codes below; the gateway maps the
code to a fallback cause (:mod:`pdproto.causes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

#: The request field that carries the convention.
KV_TRANSFER_PARAMS = "kv_transfer_params"
#: Prefill leg: compute the prompt's KV and hand it to a remote decode.
DO_REMOTE_DECODE = "do_remote_decode"
#: Decode leg: the prompt's KV comes from a remote prefill.
DO_REMOTE_PREFILL = "do_remote_prefill"
#: Names one transfer on both legs (push mode).
TRANSFER_ID = "transfer_id"
#: Push mode, prefill leg: ``host:port`` of the decode site's KV receiver.
KV_DESTINATION = "kv_destination"
#: Push mode, decode leg: seconds the decode engine waits for the KV before its KV error.
DEADLINE_S = "deadline_s"
#: Both legs (push mode): the gateway's request id (``x-request-id``), so that an engine whose
#: server does not pass the header on (vLLM's connector sees only its own request ids) still
#: names the request in its KV header and its log lines.
REQUEST_ID = "request_id"
#: Decode leg: ``none`` (answer the KV error) or ``local`` (prefill locally instead).
FALLBACK = "fallback"
#: The values of :data:`FALLBACK`.
ENGINE_FALLBACKS = ("none", "local")

#: How a remote prefill hands its KV to decode (a deployment's ``kv_transfer.mode``):
#: ``push``: pdbridge's convention; both legs at once with one ``transfer_id``, the prefill
#: engine sends the KV to the decode node's receiver (``kv_destination``).
#: ``pull``: vLLM's built-in connectors (NixlConnector, ...); the prefill leg first, with
#: :data:`PULL_PREFILL_KV`; its answer's ``kv_transfer_params`` (where the KV waits) go
#: unchanged into the decode leg, whose engine fetches the KV.
KV_MODES = ("push", "pull")
PULL_PREFILL_KV: Mapping[str, Any] = MappingProxyType(
    {
        DO_REMOTE_DECODE: True,
        DO_REMOTE_PREFILL: False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)

#: The OpenAI error ``type`` of an engine's 503 when its KV leg failed.
KV_ERROR_TYPE = "kv_transfer_error"
#: Error codes (``error.code``) of that 503.
#: The KV did not arrive within the decode leg's deadline.
KV_TIMEOUT = "kv_timeout"
#: The receiver refused the transfer (unknown, duplicate or already finished).
KV_REJECTED = "kv_rejected"
#: The KV failed verification (checksums, digests, coverage) and was not imported.
KV_CORRUPT = "kv_corrupt"
#: The link failed in a way its library did not classify (an RPC or socket error).
KV_LINK_ERROR = "kv_link_error"
#: Any other failure of the transfer.
KV_TRANSFER_FAILED = "transfer_failed"
#: The decode engine refused a transfer whose manifest is not its model's layout (a sender
#: bug or a tampered header, unlike a timeout: worth an alert of its own); also the gateway's
#: fallback cause for it.
KV_IMPORT_REFUSED = "kv_import_refused"
#: The prefill engine could not send because the decode site's KV receiver and it do not
#: accept each other (a TLS handshake refused, the sender's certificate not on the
#: receiver's allowlist); also the gateway's fallback cause for it: a certificate or an
#: allowlist to fix, never a transient fault.
KV_PEER_REFUSED = "kv_peer_refused"
#: The prefill engine could not reach the decode site's KV receiver at all within the link's
#: ``unreachable_ms`` (receiver down, path cut); also the gateway's fallback cause for it, and
#: one it fails over for: another prefill site may still reach the receiver.
KV_UNREACHABLE = "kv_unreachable"


def push_kv_params(
    transfer_id: str, kv_destination: str, deadline_s: float, request_id: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Push mode's ``kv_transfer_params`` for (the prefill leg, the decode leg): one
    ``transfer_id``; the prefill engine sends to ``kv_destination``, and the decode engine
    waits ``deadline_s`` for the KV before answering its distinct KV error. ``request_id``
    (when given) rides on both legs as :data:`REQUEST_ID`."""
    prefill = {
        DO_REMOTE_DECODE: True,
        DO_REMOTE_PREFILL: False,
        TRANSFER_ID: transfer_id,
        KV_DESTINATION: kv_destination,
    }
    decode = {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        TRANSFER_ID: transfer_id,
        DEADLINE_S: deadline_s,
    }
    if request_id:
        prefill[REQUEST_ID] = decode[REQUEST_ID] = request_id
    return prefill, decode


def pulled_kv_params(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a pull-mode prefill answer (a decoded JSON body), for
    the decode leg; None when there are none (nothing to fetch)."""
    params = answer.get(KV_TRANSFER_PARAMS) if isinstance(answer, dict) else None
    return dict(params) if isinstance(params, dict) and params else None
