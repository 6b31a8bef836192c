"""A deployment with a tidal schedule: the PrfaaS case study (4 remote, 8 local instances),
a remote site whose GPU-hour price follows a day/night tide, and a flat local price."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from console.deployments.services import deployment_transition, pool_update
from console.planner.presets import preset_scenario
from console.schedules.services import (
    local_hour,
    price_table_create,
    tidal_apply_hour,
    tidal_schedule_create,
)
from console.telemetry import names
from console.telemetry.services import samples_record_many
from tests.console.factories import NodeFactory

# Remote GPU-hour prices by hour: cheap at night (0-7), normal by day, a peak 18-21.
REMOTE_PRICES = [1.0] * 8 + [2.0] * 10 + [6.0] * 4 + [2.0] * 2
LOCAL_PRICE = 1.5
CAPACITY = [4] * 12 + [2] * 6 + [4] * 6  # two instances are taken back in the afternoon


def case_study() -> dict[str, Any]:
    body = copy.deepcopy(preset_scenario("prfaas-case-study"))
    body["grid"] = {"thresholds": 200, "spacing": "linear"}  # fast enough, same optimum shape
    return body


@pytest.fixture
def tidal(world: Any) -> Any:
    """``world`` (tests/console/conftest.py), active, plus 3 more remote prefill nodes, prices
    and an enabled schedule in UTC."""
    extra = [NodeFactory(site=world.remote, hostname=f"pre-{i}") for i in range(2, 5)]
    pool_update(actor=None, pool=world.prefill_pool, nodes=[world.prefill_node, *extra])
    world.local.gpu_hour_price = LOCAL_PRICE
    world.local.save()
    price_table_create(actor=None, site=world.remote, gpu_hour_prices=REMOTE_PRICES)
    world.schedule = tidal_schedule_create(
        actor=None,
        deployment=world.deployment,
        enabled=True,
        timezone="UTC",
        ttft_limit_ms=10_000,
        scenario=case_study(),
        remote_site=world.remote,
        local_site=world.local,
        capacity=CAPACITY,
    )
    for state in ("deploying", "active"):
        world.deployment.refresh_from_db()
        deployment_transition(actor=None, deployment=world.deployment, to_state=state)
    world.deployment.refresh_from_db()
    return world


def serve_last_hours(tidal: Any, hours: int = 3) -> None:
    """The beat applied the last ``hours`` whole hours and the gateway scrape recorded
    3 req/s remote, 1 req/s local in each of them (the hour before them: nothing)."""
    now = local_hour(tidal.schedule, timezone.now())
    for back in range(1, hours + 1):
        hour = now - timedelta(hours=back)
        tidal_apply_hour(schedule_id=tidal.schedule.pk, now=hour + timedelta(minutes=1))
        for path, rate in (("remote", 3.0), ("local", 1.0)):
            samples_record_many(
                subject=tidal.deployment,
                values={names.REQUESTS: rate},
                labels={"path": path},
                at=hour + timedelta(minutes=5),
            )
