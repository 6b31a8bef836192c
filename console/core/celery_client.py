"""Sending Celery tasks from the console by their stable names.

The console never imports workflow code (``orchestrator`` imports the console, not the other
way round), so it sends tasks by name through a Celery app configured from the same settings.
Sends happen after the surrounding transaction commits, so a worker never sees a run id that
is not in the database yet.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from celery import Celery
from django.db import transaction

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _app() -> Celery:
    app = Celery("pdbridge-console")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    return app


def send_task_on_commit(name: str, *, args: list[Any], countdown: float | None = None) -> None:
    """Queue task ``name`` once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: _app().send_task(name, args=args, countdown=countdown))


def nudge_on_commit(name: str) -> None:
    """Queue task ``name`` (no arguments) once the transaction commits, best effort: a beat job
    asked to run early, which runs on its own schedule anyway. A broker that cannot take it
    is logged, never raised into the request that asked (no publish retries either)."""

    def send() -> None:
        try:
            _app().send_task(name, retry=False)
        except Exception:  # the beat runs it at its next tick regardless
            logger.warning("task_not_queued", extra={"task": name}, exc_info=True)

    transaction.on_commit(send)
