"""HTTP names on the data plane: the headers a gateway answer carries and their values."""

from __future__ import annotations

#: Which path served a request (gateway answers; the reference engine sets it too).
PATH_HEADER = "x-pdbridge-path"
#: The values of :data:`PATH_HEADER`: the remote prefill path, local prefill by routing
#: choice, local prefill after the remote path failed before the first token.
PATHS = ("remote", "local", "fallback")
#: The request id, taken from the client or generated, passed to every leg and echoed back.
REQUEST_ID_HEADER = "x-request-id"
