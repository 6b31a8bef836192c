"""A TEST DOUBLE for the console's config endpoint (``GET /api/deployments/{id}/config/``),
serving a snapshot the test can change, with the contract's ETag / If-None-Match / 304 and
token check. A real aiohttp server on loopback; it records every poll."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aiohttp import web


class ConsoleDouble:
    def __init__(self, snapshot: dict[str, Any], token: str = "node-token") -> None:  # noqa: S107 - test token
        self.snapshot = snapshot
        self.token = token
        self.polls: list[tuple[str | None, int]] = []
        self.fail_status: int | None = None
        #: The client-key document (``/gateway-access/``); None answers 404 (an older console).
        self.access: dict[str, Any] | None = None
        self.access_polls: list[tuple[str | None, int]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    def update(self, **routing: Any) -> None:
        """Change routing and bump the version, as a console write would."""
        self.snapshot["routing"].update(routing)
        self.snapshot["version"] += 1

    async def start(self, ssl_context: Any = None) -> ConsoleDouble:
        app = web.Application()
        app.router.add_get("/api/deployments/{id}/config/", self.config)
        app.router.add_get("/api/deployments/{id}/gateway-access/", self.gateway_access)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def config(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"detail": "bad token"}, status=401)
        etag = f'"{self.snapshot["version"]}"'
        seen = request.headers.get("If-None-Match")
        if self.fail_status is not None:
            self.polls.append((seen, self.fail_status))
            return web.json_response({"detail": "injected"}, status=self.fail_status)
        if seen == etag:
            self.polls.append((seen, 304))
            return web.Response(status=304, headers={"ETag": etag})
        self.polls.append((seen, 200))
        return web.Response(
            body=json.dumps(self.snapshot), content_type="application/json", headers={"ETag": etag}
        )

    async def gateway_access(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"detail": "bad token"}, status=401)
        seen = request.headers.get("If-None-Match")
        if self.access is None:
            self.access_polls.append((seen, 404))
            return web.json_response({"detail": "Not found."}, status=404)
        body = json.dumps(self.access, sort_keys=True)
        etag = f'"{hashlib.sha256(body.encode()).hexdigest()[:16]}"'
        if seen == etag:
            self.access_polls.append((seen, 304))
            return web.Response(status=304, headers={"ETag": etag})
        self.access_polls.append((seen, 200))
        return web.Response(body=body, content_type="application/json", headers={"ETag": etag})
