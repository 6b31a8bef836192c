"""Names shared by pdbridge's gateway, its engines and its vLLM connector.

The wire convention between a router and the engines it drives: the ``kv_transfer_params``
fields of a request and their helpers (:mod:`pdproto.kv`), the error codes an engine answers
when the KV did not make it and the gateway's fallback causes (:mod:`pdproto.causes`), and the
HTTP header names and path values a response carries (:mod:`pdproto.http`); and the
prompt-length mix format of synthetic load that the console stores and validates and the
agent's load generator reads (:mod:`pdproto.loadmix`).

Neutral on purpose: pure standard library, importing nothing of pdbridge (no Django, no agent,
no link, no aiohttp or torch), so that the code running inside a vLLM process can import it
beside the gateway and the reference engine. ``tests/test_import_direction.py`` keeps it so.
"""

from __future__ import annotations

from pdproto.causes import FAILOVER_CAUSES, FALLBACK_CAUSES
from pdproto.http import (
    ATTEMPTS,
    FAILOVER_CAUSE_HEADER,
    FAILOVER_FROM_HEADER,
    PATH_HEADER,
    PATHS,
    REQUEST_ID_HEADER,
    SITE_HEADER,
)
from pdproto.kv import (
    KV_ERROR_TYPE,
    KV_IMPORT_REFUSED,
    KV_MODES,
    KV_PEER_REFUSED,
    PULL_PREFILL_KV,
    pulled_kv_params,
    push_kv_params,
)

__all__ = [
    "ATTEMPTS",
    "FAILOVER_CAUSES",
    "FAILOVER_CAUSE_HEADER",
    "FAILOVER_FROM_HEADER",
    "FALLBACK_CAUSES",
    "KV_ERROR_TYPE",
    "KV_IMPORT_REFUSED",
    "KV_MODES",
    "KV_PEER_REFUSED",
    "PATHS",
    "PATH_HEADER",
    "PULL_PREFILL_KV",
    "REQUEST_ID_HEADER",
    "SITE_HEADER",
    "pulled_kv_params",
    "push_kv_params",
]
