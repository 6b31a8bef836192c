"""The request trace: one request's path and timeline as the gateway records it, the shape
the gateway's ``/debug/traces`` serves and ships to the console, and the console stores and
draws. Standard library only (the gateway writes it, the console reads it).

A trace is a JSON object::

    {"version": 1, "request_id": "...", "started_at": "2026-12-01T10:00:00.123+00:00",
     "kind": "completions", "stream": true, "path": "remote", "outcome": "ok", "status": 200,
     "site": "remote", "transfer_id": "...", "fallback_cause": null, "failover": null,
     "prompt_tokens": 4096, "kv": {"bytes": 539648, "bytes_wire": 401112, ...},
     "legs": [{"leg": "queue", "start_ms": 0.0, "end_ms": 0.1}, ...],
     "attempts": [...], "first_token_ms": 812.4, "total_ms": 1203.9}

``started_at`` is the gateway's wall clock when the request arrived; every ``*_ms`` is
milliseconds after it on the gateway's monotonic clock, so a trace is internally consistent
whatever the clocks of the engines' nodes say. Legs (:data:`LEGS`) carry ``site`` and
``instance`` (the engine's node hostname) where one served them. ``local_prefill`` (added
with the local prefill pool): on a local request of a deployment that has one, ``served`` or
why the decode engine prefilled it itself (``local_prefill_unavailable`` or the failed
attempt's cause, that attempt in ``attempts``); null otherwise.
"""

from __future__ import annotations

#: Version of the trace document (``version``); fields are only ever added.
TRACE_VERSION = 1
#: The legs a trace may carry, in timeline order:
#: ``queue``: admission wait at the gateway (arrival to admitted);
#: ``prefill``: the prefill leg at a remote site (sent to answered; push mode: the prefill
#: engine answers once its KV was confirmed by the decode site's receiver);
#: ``transfer``: the KV on the wire, as the prefill engine measured it (``send_seconds``),
#: ending when the prefill leg answered;
#: ``decode``: the decode leg (remote path) or the one local leg (local, fallback): sent to
#: its last byte relayed;
#: ``first_token``: a point, the first byte relayed to the client (a stream's first event).
LEGS = ("queue", "prefill", "transfer", "decode", "first_token")
#: The gateway's endpoint: ``GET /debug/traces`` (recent, newest first) and
#: ``GET /debug/traces/{request_id}``.
TRACE_PATH = "/debug/traces"
#: The console's API the gateway ships sampled traces to (``POST``, a node token).
CONSOLE_TRACES_PATH = "/api/telemetry/trace-batches/"
#: At most this many traces in one shipped batch (the console refuses larger ones).
MAX_TRACES_PER_BATCH = 200
#: At most this many failed remote attempts kept in one trace (a request fails over once by
#: default; the cap bounds a trace's size whatever the settings).
MAX_ATTEMPTS = 4
