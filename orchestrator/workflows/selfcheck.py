"""``selfcheck``: proves the control plane executes work end to end — the database answers,
a worker picks the run up, and a scheduled re-check fires (the mechanism canaries and drills
use for their waits). Operators run it after installing or upgrading workers."""

from __future__ import annotations

import os
import platform
import socket
import time

import celery
from django.db import connection

from orchestrator.steps import Done, Step, StepContext, StepResult, Wait


def database(ctx: StepContext) -> StepResult:
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return Done(
        {
            "vendor": connection.vendor,
            "round_trip_ms": round((time.perf_counter() - started) * 1000, 3),
        }
    )


def worker(ctx: StepContext) -> StepResult:
    return Done(
        {
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "celery": celery.__version__,
            "python": platform.python_version(),
        }
    )


def scheduled_recheck(ctx: StepContext) -> StepResult:
    delay = float(ctx.params.get("recheck_s", 1.0))
    if "scheduled_at" not in ctx.evidence:
        return Wait(delay, {"scheduled_at": time.time(), "delay_s": delay})
    late_by = time.time() - ctx.evidence["scheduled_at"] - delay
    return Done({**ctx.evidence, "late_by_s": round(late_by, 3)})


STEPS = [
    Step("database", database),
    Step("worker", worker),
    Step("scheduled_recheck", scheduled_recheck),
]
