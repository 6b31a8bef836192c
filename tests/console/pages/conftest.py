"""Fixtures for the page tests: a logged-in client per role and a system with a few thousand
runs and telemetry samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from console.runs.models import StepRun, WorkflowRun
from console.runs.services import run_create
from console.telemetry import names
from console.telemetry.models import MetricSample
from tests.console.conftest import World

PATHS = ("remote", "local", "fallback")


@pytest.fixture
def client_as(make_user: Callable[..., Any]) -> Callable[[str | None], Client]:
    """A test client logged in as a fresh user of ``role`` (None: a user with no role)."""

    def make(role: str | None) -> Client:
        client = Client()
        client.force_login(make_user(role))
        return client

    return make


@dataclass
class Pages:
    """The URL of every page for a world, and the run shown on the run page."""

    world: World
    run: WorkflowRun

    def urls(self) -> dict[str, str]:
        w = self.world
        return {
            "overview": "/",
            "sites": "/sites/",
            "site": f"/sites/{w.local.pk}/",
            "nodes": "/nodes/",
            "node": f"/nodes/{w.decode_node.pk}/",
            "links": "/links/",
            "link": f"/links/{w.link.pk}/",
            "alerts": "/alerts/",
            "models": "/models/",
            "model": f"/models/{w.model.pk}/",
            "deployments": "/deployments/",
            "deployment": f"/deployments/{w.deployment.pk}/",
            "runs": "/runs/",
            "run": f"/runs/{self.run.pk}/",
            "run-steps": f"/runs/{self.run.pk}/steps/",
            "security": "/security/",
            "audit": "/audit/",
        }


@pytest.fixture
def pages(world: World) -> Pages:
    run = run_create(
        actor=None,
        kind="selfcheck",
        steps=["database", "worker", "scheduled_recheck"],
        target=world.deployment,
        start=False,
    )
    return Pages(world, run)


def add_runs(count: int, *, target: Any = None) -> None:
    """``count`` finished runs with three steps each, in two bulk inserts."""
    now = timezone.now()
    runs = WorkflowRun.objects.bulk_create(
        WorkflowRun(
            kind="selfcheck",
            state="succeeded" if i % 5 else "failed",
            target_type="deployments.deployment" if target is not None else "",
            target_id=str(target.pk) if target is not None else "",
            started_at=now,
            finished_at=now,
        )
        for i in range(count)
    )
    StepRun.objects.bulk_create(
        StepRun(run=run, index=i, name=name, state="succeeded", evidence={"i": i})
        for run in runs
        for i, name in enumerate(["database", "worker", "scheduled_recheck"])
    )


def add_samples(world: World, per_series: int) -> int:
    """History for the deployment (every chart metric, each path), the link and the node."""
    now = timezone.now()
    rows = []

    def series(
        subject_type: str, subject_id: int, name: str, labels: dict[str, str], base: float
    ) -> None:
        for i in range(per_series):
            rows.append(
                MetricSample(
                    subject_type=subject_type,
                    subject_id=str(subject_id),
                    name=name,
                    labels=labels,
                    value=base * (1 + 0.1 * (i % 7)),
                    at=now - timedelta(seconds=10 * (per_series - i)),
                )
            )

    dep = world.deployment.pk
    for path in PATHS:
        for name, base in [
            (names.TTFT_P50, 0.2),
            (names.TTFT_P99, 0.8),
            (names.TPOT, 0.02),
            (names.REQUESTS, 5.0),
        ]:
            series("deployments.deployment", dep, name, {"path": path}, base)
    series("deployments.deployment", dep, names.SUCCESS, {}, 0.99)
    series("deployments.deployment", dep, names.EFFECTIVE_THRESHOLD, {}, 4096)
    for name, base in [
        (names.LINK_MEASURED_MBIT_S, 900.0),
        (names.LINK_RTT_MS, 10.0),
        (names.LINK_UTILIZATION, 0.4),
    ]:
        series("inventory.link", world.link.pk, name, {}, base)
    for name, base in [(names.NODE_CLOCK_SKEW_MS, 2.0), (names.NODE_CHILDREN_HEALTHY, 3)]:
        series("inventory.node", world.decode_node.pk, name, {}, base)
    MetricSample.objects.bulk_create(rows, batch_size=2000)
    return len(rows)
