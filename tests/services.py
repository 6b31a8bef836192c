"""Which real services the test run uses.

Postgres and Redis are used when reachable. Under ``CI=true`` a missing service is a failure
(never a silent fallback); elsewhere the suite falls back to SQLite and skips only what truly
needs Redis, saying so in the summary.

Environment: ``DATABASE_URL`` (explicit choice), ``PDBRIDGE_TEST_PG`` (host:port, default
127.0.0.1:5432), ``PDBRIDGE_TEST_PG_DB`` (database name prefix, default ``pdbridge``; parallel
checkouts on one machine set different ones), ``REDIS_URL`` / ``PDBRIDGE_TEST_REDIS_DB``.
"""

from __future__ import annotations

import os
import socket

IN_CI = os.environ.get("CI", "").lower() == "true"


def reachable(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _host_port(value: str, default_port: int) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return (host or value, int(port) if port.isdigit() else default_port)


def database_url() -> str:
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    host, port = _host_port(os.environ.get("PDBRIDGE_TEST_PG", "127.0.0.1:5432"), 5432)
    if reachable(host, port):
        name = os.environ.get("PDBRIDGE_TEST_PG_DB", "pdbridge")
        return f"postgres://postgres@{host}:{port}/{name}"
    if IN_CI:
        raise RuntimeError(f"CI=true but PostgreSQL is not reachable at {host}:{port}")
    return "sqlite:///" + os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "var", "test.sqlite3"
    )


def redis_url() -> str | None:
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    if reachable("127.0.0.1", 6379):
        return f"redis://127.0.0.1:6379/{os.environ.get('PDBRIDGE_TEST_REDIS_DB', '15')}"
    if IN_CI:
        raise RuntimeError("CI=true but Redis is not reachable at 127.0.0.1:6379")
    return None
