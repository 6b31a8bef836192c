"""The reference engine's optional API key, as vLLM's ``--api-key`` works: when a key is set,
every ``/v1/...`` request must carry ``Authorization: Bearer <key>`` and gets 401
``{"error": "Unauthorized"}`` without it; ``/health``, ``/metrics`` and the other paths stay
open (vLLM leaves them open too, so probes and scrapers need no key).

Who calls it: ``ReferenceEngine.app`` adds :func:`api_key_middleware` when
``EngineSettings.api_key`` is set; ``pdbridge engine serve`` takes the key from ``--api-key``,
else ``VLLM_API_KEY`` (vLLM's variable), else the file named by ``--api-key-file``.
"""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web


def api_key_middleware(api_key: str) -> Any:
    """An aiohttp middleware refusing ``/v1/`` requests without the key (constant-time
    comparison, as the key is compared itself rather than a hash)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check
