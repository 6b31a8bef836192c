"""The periodic jobs (node liveness, telemetry retention, alerts, tidal apply, rebalancing)
executed by a real Celery worker process over the test broker and database. The tasks are
sent by name, as beat sends them; the schedule table is checked to name each of them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console.alerts.models import Alert
from console.alerts.services import alert_rules_sync_defaults
from console.core import celery_client
from console.inventory.models import Node
from console.schedules.models import TidalApplication
from console.telemetry.models import MetricSample
from console.telemetry.services import sample_record
from orchestrator.celery import app
from orchestrator.queues import BEAT_SCHEDULE
from tests.console.conftest import world  # noqa: F401 - fixture used by ``tidal``
from tests.console.schedules.conftest import tidal  # noqa: F401 - fixture
from tests.support import wait_for

JOBS = {
    "orchestrator.inventory.mark_missing",
    "orchestrator.telemetry.prune_samples",
    "orchestrator.telemetry.collect_gateways",
    "orchestrator.alerts.evaluate",
    "orchestrator.schedules.apply_tidal",
    "orchestrator.schedules.propose_rebalance",
}


def send(name: str) -> None:
    celery_client._app().send_task(name)


def test_every_job_is_scheduled_and_registered():
    scheduled = {entry["task"] for entry in BEAT_SCHEDULE.values()}
    assert scheduled >= JOBS
    app.loader.import_default_modules()  # what a worker does at start (``imports``)
    assert set(app.tasks) >= JOBS


@pytest.mark.django_db(transaction=True)
def test_worker_runs_liveness_retention_alerts_and_tidal_jobs(start_worker, tidal):  # noqa: F811
    alert_rules_sync_defaults()  # a transactional test's flush removes migration data
    now = timezone.now()
    stale = tidal.decode_node
    Node.objects.filter(pk=stale.pk).update(
        status="online", last_heartbeat_at=now - timedelta(hours=1)
    )
    old = sample_record(
        subject=tidal.link, name="link_rtt_ms", value=10.0, at=now - timedelta(days=30)
    )
    sample_record(
        subject=tidal.link, name="link_rtt_ms", value=2000.0, at=now - timedelta(seconds=5)
    )
    start_worker()

    for name in sorted(JOBS):
        send(name)

    wait_for(lambda: Node.objects.get(pk=stale.pk).status == "lost")
    wait_for(lambda: not MetricSample.objects.filter(pk=old.pk).exists())
    wait_for(lambda: Alert.objects.filter(rule_name="link-rtt-high", state="firing").exists())
    row = wait_for(lambda: TidalApplication.objects.filter(schedule=tidal.schedule).first())
    assert row.outcome == "applied"
    assert row.hour == now.hour or row.hour == (now.hour + 1) % 24  # the worker's clock
    assert MetricSample.objects.filter(name="link_rtt_ms").count() == 1
