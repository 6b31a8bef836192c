"""The Celery app: configured from the console's settings (``CELERY_*``), queues from
``orchestrator.queues``, tasks from ``orchestrator.tasks``.

Start a worker with ``celery -A orchestrator.celery worker`` (or ``pdbridge worker``) and beat
with ``celery -A orchestrator.celery beat``.
"""

from __future__ import annotations

import os

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup()

from orchestrator import queues  # noqa: E402

app = Celery("pdbridge")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    task_queues=queues.task_queues(),
    task_default_queue=queues.DEFAULT_QUEUE,
    task_routes=queues.route_task,
    # Run records are the truth; a message is acknowledged only after its task returned, and a
    # worker lost mid-task gives its message back.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_track_started=True,
    timezone="UTC",
    enable_utc=True,
    beat_scheduler="django_celery_beat.schedulers:DatabaseScheduler",
    beat_schedule=queues.BEAT_SCHEDULE,
    imports=[
        "orchestrator.tasks.runs",
        "orchestrator.tasks.schedules",
        "orchestrator.tasks.alerts",
        "orchestrator.tasks.housekeeping",
        "orchestrator.tasks.drills",
    ],
)
