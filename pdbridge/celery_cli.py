"""``pdbridge worker`` / ``pdbridge beat``: Celery processes of the orchestrator with the
project's app, so operators need not remember ``-A orchestrator.celery``."""

from __future__ import annotations


def _celery(argv: list[str]) -> int:
    from celery.bin.celery import main as celery_main

    try:
        celery_main(["celery", "-A", "orchestrator.celery", *argv])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def worker(argv: list[str]) -> int:
    """A Celery worker consuming the default queue (add ``-Q pdbridge,site.NAME`` for a site)."""
    return _celery(["worker", *argv])


def beat(argv: list[str]) -> int:
    """Celery beat with the database scheduler (django-celery-beat)."""
    return _celery(["beat", *argv])
