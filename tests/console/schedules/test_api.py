"""Schedules API: role matrix, what-if (GET stored inputs, POST overrides), 400s naming the
field, application history and proposal actions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from console.schedules.models import RebalanceProposal
from console.schedules.services import tidal_apply_hour
from tests.console.schedules.conftest import CAPACITY, case_study

pytestmark = pytest.mark.django_db


def schedule_body(w, **extra):
    return {
        "deployment": w.deployment.pk,
        "scenario": case_study(),
        "remote_site": w.remote.pk,
        "local_site": w.local.pk,
        "capacity": CAPACITY,
        **extra,
    }


@pytest.mark.parametrize(
    ("role", "status"), [(None, 401), ("viewer", 200), ("operator", 200), ("admin", 200)]
)
def test_reads_and_what_if_need_viewer(tidal, api_as, role, status):
    api = api_as(role)
    for path in (
        "/api/tidal-schedules/",
        f"/api/tidal-schedules/{tidal.schedule.pk}/",
        f"/api/tidal-schedules/{tidal.schedule.pk}/what-if/",
        "/api/site-prices/",
        "/api/tidal-applications/",
        "/api/rebalance-proposals/",
    ):
        assert api.get(path).status_code == status, path
    response = api.post(f"/api/tidal-schedules/{tidal.schedule.pk}/what-if/", {}, format="json")
    assert response.status_code == status


@pytest.mark.parametrize(("role", "status"), [("viewer", 403), ("operator", 201), ("admin", 201)])
def test_writes_need_operator(world, api_as, role, status):
    api = api_as(role)
    response = api.post("/api/tidal-schedules/", schedule_body(world), format="json")
    assert response.status_code == status
    response = api.post(
        "/api/site-prices/", {"site": world.remote.pk, "gpu_hour_prices": [2.5] * 24}, format="json"
    )
    assert response.status_code == status


def test_what_if_returns_the_day_and_both_baselines(tidal, api_as):
    response = api_as("viewer").get(f"/api/tidal-schedules/{tidal.schedule.pk}/what-if/")

    body = response.json()
    assert [h["remote_instances"] for h in body["hours"]] == [4] * 12 + [2] * 6 + [0] * 4 + [4] * 2
    assert len(body["all_local"]) == len(body["always_remote"]) == 24
    assert set(body["totals"]) == {"tidal", "all_local", "always_remote"}
    assert body["saving"]["vs_all_local"] > 0
    assert body["deployment"] == {"id": tidal.deployment.pk, "name": "demo"}


def test_what_if_post_overrides_without_saving(tidal, api_as):
    api = api_as("viewer")
    response = api.post(
        f"/api/tidal-schedules/{tidal.schedule.pk}/what-if/",
        {"remote_prices": [100.0] * 24},
        format="json",
    )
    assert response.status_code == 200
    assert {h["remote_instances"] for h in response.json()["hours"]} == {0}
    again = api.get(f"/api/tidal-schedules/{tidal.schedule.pk}/what-if/").json()
    assert again["hours"][0]["remote_instances"] == 4


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"capacity": [1] * 23}, "capacity"),
        ({"capacity": [1] * 23 + ["x"]}, "capacity[23]"),
        ({"remote_prices": [1.0] * 23 + [-1]}, "remote_prices[23]"),
        ({"scenario": {**case_study(), "decode": {"batch_size": 0}}}, "scenario.decode"),
        ({"ttft_limit_ms": 0}, "ttft_limit_ms"),
        ({"demand_rps": [1.0] * 23 + [-2]}, "demand_rps[23]"),
        ({"budget": 3}, "budget"),
    ],
)
def test_what_if_bad_input_is_a_400_naming_the_field(tidal, api_as, body, field):
    response = api_as("viewer").post(
        f"/api/tidal-schedules/{tidal.schedule.pk}/what-if/", body, format="json"
    )
    assert response.status_code == 400
    assert any(key.startswith(field) for key in response.json()), response.json()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"capacity": [2000] * 24}, "capacity[0]"),
        ({"scenario": {"remote": {}}}, "scenario.lengths"),
        ({"gpus_per_instance": 0}, "gpus_per_instance"),
        ({"demand_rps": [1.0] * 12}, "demand_rps"),
    ],
)
def test_schedule_bad_input_is_a_400_naming_the_field(world, api_as, extra, field):
    response = api_as("operator").post(
        "/api/tidal-schedules/", schedule_body(world, **extra), format="json"
    )
    assert response.status_code == 400
    assert any(key.startswith(field) for key in response.json()), response.json()


def test_same_site_twice_and_price_table_errors(world, api_as):
    api = api_as("operator")
    body = schedule_body(world, remote_site=world.local.pk)
    response = api.post("/api/tidal-schedules/", body, format="json")
    assert response.status_code == 400
    assert "remote_site" in response.json()
    response = api.post(
        "/api/site-prices/",
        {"site": world.remote.pk, "gpu_hour_prices": [1] * 24, "energy_prices_kwh": [0.1] * 12},
        format="json",
    )
    assert response.status_code == 400
    assert "energy_prices_kwh" in response.json()


def test_energy_prices_add_to_the_gpu_hour_price(world, api_as):
    api = api_as("operator")
    api.post(
        "/api/site-prices/",
        {
            "site": world.remote.pk,
            "gpu_hour_prices": [1.0] * 24,
            "energy_prices_kwh": [0.2] * 24,
            "kw_per_gpu": 0.7,
        },
        format="json",
    )
    from console.schedules.services import site_hourly_prices

    assert site_hourly_prices(world.remote) == pytest.approx([1.14] * 24)


def test_applications_are_listed_with_their_evidence(tidal, api_as):
    tidal_apply_hour(schedule_id=tidal.schedule.pk, now=datetime(2026, 11, 30, 5, tzinfo=UTC))

    rows = api_as("viewer").get(f"/api/tidal-applications/?schedule={tidal.schedule.pk}").json()

    assert rows["count"] == 1
    row = rows["results"][0]
    assert row["outcome"] == "applied"
    assert row["hour"] == 5
    assert row["scale"]["remote_instances"] == 4


def test_proposal_actions_need_operator_and_409_when_not_open(tidal, api_as):
    proposal = RebalanceProposal.objects.create(
        deployment=tidal.deployment, reason="test", moves=[]
    )
    path = f"/api/rebalance-proposals/{proposal.pk}/dismiss/"
    assert api_as("viewer").post(path).status_code == 403
    response = api_as("operator").post(path)
    assert response.status_code == 200
    assert response.json()["state"] == "dismissed"
    assert api_as("operator").post(path).status_code == 409


def test_what_if_with_a_demand_curve(tidal, api_as):
    response = api_as("viewer").post(
        f"/api/tidal-schedules/{tidal.schedule.pk}/what-if/",
        {"demand_rps": [0.01] * 24},
        format="json",
    )

    hours = response.json()["hours"]
    assert {h["remote_instances"] for h in hours} == {0}  # a trickle: the local pool carries it
    assert all(h["served_rps"] == 0.01 and h["meets_demand"] for h in hours)


# --- recorded cost: the recorded traffic priced with and without the schedule ----------------


def _recorded(api, schedule, query=""):
    return api.get(f"/api/tidal-schedules/{schedule.pk}/recorded-cost/{query}")


@pytest.mark.parametrize(
    ("role", "status"),
    [(None, 401), ("norole", 403), ("viewer", 200), ("operator", 200), ("admin", 200)],
)
def test_recorded_cost_needs_viewer(tidal, api_as, make_user, role, status):
    from rest_framework.test import APIClient

    from console.core.services_tokens import api_token_issue

    if role == "norole":
        api = APIClient()
        api.credentials(
            HTTP_AUTHORIZATION=f"Token {api_token_issue(actor=None, user=make_user(None))[1]}"
        )
    else:
        api = api_as(role)
    assert _recorded(api, tidal.schedule).status_code == status


def test_recorded_cost_prices_the_hours_recorded_and_applied(tidal, api_as):
    from django.utils import timezone

    from console.schedules.services import local_hour
    from console.telemetry import names
    from console.telemetry.services import samples_record_many

    hour = local_hour(tidal.schedule, timezone.now()) - timedelta(hours=2)
    tidal_apply_hour(schedule_id=tidal.schedule.pk, now=hour + timedelta(minutes=1))
    for path, rate in (("remote", 3.0), ("local", 1.0)):
        samples_record_many(
            subject=tidal.deployment,
            values={names.REQUESTS: rate},
            labels={"path": path},
            at=hour + timedelta(minutes=5),
        )

    response = _recorded(api_as("viewer"), tidal.schedule, "?days=1")

    body = response.json()
    assert response.status_code == 200
    assert len(body["hours"]) == 24
    assert body["window"]["days"] == 1
    assert body["window"]["deployment"] == {"id": tidal.deployment.pk, "name": "demo"}
    assert body["hours_with_data"] == 1
    found = next(h for h in body["hours"] if not h["gap"])
    assert found["hour_start"] == hour.isoformat()
    assert found["requests"] == 4.0 * 3600
    assert found["scheduled"]["source"] == "applied"
    assert body["static_remote_instances"] == 4
    assert set(body["totals"]) == {"scheduled", "static"}
    assert body["totals"]["scheduled"]["cost_per_million_tokens"] > 0

    pinned = _recorded(api_as("viewer"), tidal.schedule, "?days=1&static_remote_instances=0")
    assert pinned.json()["static_remote_instances"] == 0


def test_recorded_cost_defaults_to_seven_days_and_says_when_nothing_was_recorded(tidal, api_as):
    body = _recorded(api_as("viewer"), tidal.schedule).json()

    assert body["window"]["days"] == 7
    assert len(body["hours"]) == 168
    assert body["empty"] is True
    assert body["totals"]["scheduled"]["cost_per_million_tokens"] is None


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?days=0", "days"),
        ("?days=32", "days"),
        ("?days=seven", "days"),
        ("?static_remote_instances=-1", "static_remote_instances"),
        ("?static_remote_instances=257", "static_remote_instances"),
        ("?static_remote_instances=1.5", "static_remote_instances"),
    ],
)
def test_recorded_cost_bad_query_is_a_400_naming_the_field(tidal, api_as, query, field):
    response = _recorded(api_as("viewer"), tidal.schedule, query)

    assert response.status_code == 400
    assert list(response.json()) == [field]


def test_recorded_cost_of_a_schedule_that_does_not_parse_names_the_field(tidal, api_as):
    from console.schedules.models import TidalSchedule

    TidalSchedule.objects.filter(pk=tidal.schedule.pk).update(capacity=[1, 2])

    response = _recorded(api_as("viewer"), tidal.schedule)

    assert response.status_code == 400
    assert "capacity" in response.json()


def test_recorded_cost_of_an_unknown_schedule_is_a_404(db, api_as):
    assert api_as("viewer").get("/api/tidal-schedules/999999/recorded-cost/").status_code == 404
