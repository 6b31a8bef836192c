"""HTTP names on the data plane: the headers a gateway answer carries and their values."""

from __future__ import annotations

#: Which path served a request (gateway answers; the reference engine sets it too).
PATH_HEADER = "x-pdbridge-path"
#: The values of :data:`PATH_HEADER`: the remote prefill path, local prefill by routing
#: choice, local prefill after the remote path failed before the first token.
PATHS = ("remote", "local", "fallback")
#: The request id, taken from the client or generated, passed to every leg and echoed back.
REQUEST_ID_HEADER = "x-request-id"
#: The remote prefill site whose KV served a ``remote`` answer.
SITE_HEADER = "x-pdbridge-prefill-site"
#: On an answer whose first prefill site failed and was failed over: that site, and the
#: cause (one of :data:`pdproto.causes.FAILOVER_CAUSES`).
FAILOVER_FROM_HEADER = "x-pdbridge-failover-from"
FAILOVER_CAUSE_HEADER = "x-pdbridge-failover-cause"
#: Which prefill attempt served a remote answer: the first site chosen, or the site failed
#: over to (label ``attempt`` of ``pdbridge_gateway_remote_served_total``).
ATTEMPTS = ("first", "failover")
