"""HTTP names on the data plane: the headers a gateway answer carries and their values."""

from __future__ import annotations

#: Which path served a request (gateway answers; the reference engine sets it too).
PATH_HEADER = "x-pdbridge-path"
#: The values of :data:`PATH_HEADER`: the remote prefill path, local prefill by routing
#: choice, local prefill after the remote path failed before the first token.
PATHS = ("remote", "local", "fallback")
#: The request id, taken from the client or generated, passed to every leg and echoed back
#: (vLLM's ``X-Request-Id`` convention: engines take it as their request's id and log it).
REQUEST_ID_HEADER = "x-request-id"
#: The most characters of a request id that engines, the KV header and traces keep (a client
#: may send a longer one; the gateway echoes it whole, everything downstream clips it).
REQUEST_ID_MAX_CHARS = 128


def clip_request_id(value: str) -> str:
    """A request id as engines, the KV link and traces record it: at most
    :data:`REQUEST_ID_MAX_CHARS` characters, control characters replaced by ``?`` (log lines
    stay one line each)."""
    clipped = value[:REQUEST_ID_MAX_CHARS]
    if clipped.isprintable():
        return clipped
    return "".join(c if c.isprintable() else "?" for c in clipped)


#: The remote prefill site whose KV served a ``remote`` answer.
SITE_HEADER = "x-pdbridge-prefill-site"
#: On an answer whose first prefill site failed and was failed over: that site, and the
#: cause (one of :data:`pdproto.causes.FAILOVER_CAUSES`).
FAILOVER_FROM_HEADER = "x-pdbridge-failover-from"
FAILOVER_CAUSE_HEADER = "x-pdbridge-failover-cause"
#: Which prefill attempt served a remote answer: the first site chosen, or the site failed
#: over to (label ``attempt`` of ``pdbridge_gateway_remote_served_total``).
ATTEMPTS = ("first", "failover")
