"""``pdbridge worker`` / ``pdbridge beat``: Celery processes of the orchestrator with the
project's app, so operators need not remember ``-A orchestrator.celery``. The process is
replaced by Celery's own (signals and exit codes are Celery's)."""

from __future__ import annotations

import os
import sys


def _exec_celery(argv: list[str]) -> int:
    command = [sys.executable, "-m", "celery", "-A", "orchestrator.celery", *argv]
    os.execv(sys.executable, command)  # noqa: S606 - fixed interpreter, no shell
    return 0  # not reached


def worker(argv: list[str]) -> int:
    """A Celery worker consuming the default queue (add ``-Q pdbridge,site.NAME`` for a site)."""
    return _exec_celery(["worker", *argv])


def beat(argv: list[str]) -> int:
    """Celery beat with the database scheduler (django-celery-beat)."""
    return _exec_celery(["beat", *argv])
