"""The gateway's fallback causes: why a request meant for the remote path was served by local
prefill. They label ``pdbridge_gateway_fallbacks_total`` and the ``fallback_reason`` of the
answer; an engine or connector that wants the gateway to name a cause answers the matching
KV error code (:mod:`pdproto.kv`). :data:`FAILOVER_CAUSES`, a subset, are the causes for which
a remote request is first sent to another prefill site (``pdbridge_gateway_prefill_failovers_total``
and the ``x-pdbridge-failover-cause`` header of the answer)."""

from __future__ import annotations

from pdproto.kv import KV_IMPORT_REFUSED, KV_PEER_REFUSED, KV_TIMEOUT, KV_UNREACHABLE

#: Every remote site's breaker is open (or the chosen one tripped before the legs left).
BREAKER_OPEN = "breaker_open"
#: Every healthy site's link is above its utilisation ceiling.
LINK_SATURATED = "link_saturated"
#: No remote site is configured or selectable.
NO_REMOTE_SITE = "no_remote_site"
#: The prefill leg failed (5xx, connection error) before the first token.
PREFILL_ERROR = "prefill_error"
#: The prefill leg ran past its timeout.
PREFILL_TIMEOUT = "prefill_timeout"
#: The decode leg failed naming the KV (checksum, rejected, lost transfer).
KV_TRANSFER = "kv_transfer"
#: The decode leg failed for another reason before the first token.
DECODE_ERROR = "decode_error"
# KV_TIMEOUT (the engine's code, imported above) is a cause too: the KV missed the
# deployment's deadline -- the prefill engine's send or the decode engine's wait said so
# (their 503 ``kv_timeout``), or the decode leg sent no first byte within the deadline plus
# the gateway's grace. A deadline, never counted as damaged KV (``kv_transfer``).

#: Every cause, in the order the metrics and the docs list them.
FALLBACK_CAUSES = (
    BREAKER_OPEN,
    LINK_SATURATED,
    NO_REMOTE_SITE,
    PREFILL_ERROR,
    PREFILL_TIMEOUT,
    KV_TRANSFER,
    KV_IMPORT_REFUSED,
    KV_PEER_REFUSED,
    KV_UNREACHABLE,
    KV_TIMEOUT,
    DECODE_ERROR,
)

#: The causes that send a remote request to the next-best prefill site (once, with a fresh
#: transfer id) before local fallback: failures of the prefill leg before any KV reached the
#: decode engine -- its site's breaker tripped before the leg left, it could not connect or
#: answered 5xx / refused (``prefill_error``), it ran past its site timeout
#: (``prefill_timeout``), the decode site's receiver refused that site's engine
#: (``kv_peer_refused``) or that site's engine could not reach it (``kv_unreachable``: its
#: path cut, while another site's may not be). A failure the decode engine saw (damaged, refused or late KV) and
#: the decode leg's own failures never fail over: the request's KV deadline is spent.
FAILOVER_CAUSES = (BREAKER_OPEN, PREFILL_ERROR, PREFILL_TIMEOUT, KV_PEER_REFUSED, KV_UNREACHABLE)
