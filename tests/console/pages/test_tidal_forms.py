"""The tidal schedule form and the per-site price tables: an operator creates and edits a
schedule (capacity and demand as 24 inputs, the planner scenario as JSON) and lands on its
plan; prices save in place with htmx; a bad hour is marked with the service's message and
nothing is written; viewers see no form and a crafted POST is 403; every write is audited."""

from __future__ import annotations

import json
from typing import Any

from console.core.models import AuditLog
from console.schedules.models import SitePriceTable, TidalSchedule
from console.schedules.services import price_table_create
from tests.console.schedules.conftest import (  # noqa: F401  (tidal: a fixture)
    CAPACITY,
    REMOTE_PRICES,
    case_study,
    tidal,
)


def _hours(prefix: str, values: list[Any]) -> dict[str, str]:
    return {f"{prefix}_{h}": str(v) for h, v in enumerate(values)}


def _post(world: Any, **overrides: Any) -> dict[str, str]:
    body = {
        "deployment": str(world.deployment.pk),
        "remote_site": str(world.remote.pk),
        "local_site": str(world.local.pk),
        "timezone": "Europe/Paris",
        "ttft_limit_ms": "10000",
        "gpus_per_instance": "8",
        "rtt_ms": "12.5",
        "scenario": json.dumps(case_study()),
        **_hours("capacity", CAPACITY),
    }
    body.update(overrides)
    return body


def test_operator_creates_a_schedule_and_lands_on_its_plan(client_as, world):
    client = client_as("operator")

    form = client.get(f"/tidal/new/?deployment={world.deployment.pk}").content.decode()
    response = client.post("/tidal/new/", _post(world, enabled="on"))

    assert form.count('name="capacity_') == 24
    assert "&quot;remote&quot;: {" in form  # the case study to start from
    schedule = TidalSchedule.objects.get(deployment=world.deployment)
    assert response.status_code == 302
    assert response["Location"] == f"/tidal/{schedule.pk}/"
    assert schedule.capacity == CAPACITY
    assert schedule.demand_rps == []
    assert (schedule.timezone, schedule.rtt_ms, schedule.enabled) == ("Europe/Paris", 12.5, True)
    assert schedule.scenario == case_study()
    page = client.get(response["Location"]).content.decode()
    assert f"Tidal schedule of {world.deployment.name} created." in page
    assert page.count("plotly-graph-div") == 3  # the plan was computed
    entry = AuditLog.objects.get(object_type="schedules.tidalschedule")
    assert (entry.action, entry.object_id) == ("create", str(schedule.pk))
    assert entry.actor == response.wsgi_request.user


def test_operator_edits_a_schedule(client_as, tidal):  # noqa: F811
    schedule = tidal.schedule
    client = client_as("operator")
    demand = [1.5] * 24

    form = client.get(f"/tidal/{schedule.pk}/edit/").content.decode()
    response = client.post(
        f"/tidal/{schedule.pk}/edit/",
        _post(tidal, timezone="UTC", ttft_limit_ms="8000", **_hours("demand_rps", demand)),
    )

    assert 'name="capacity_12" value="2"' in form
    assert response.status_code == 302
    schedule.refresh_from_db()
    assert (schedule.ttft_limit_ms, schedule.demand_rps, schedule.enabled) == (8000, demand, False)
    entry = AuditLog.objects.filter(object_type="schedules.tidalschedule").latest("id")
    assert entry.action == "update"
    assert (entry.before["ttft_limit_ms"], entry.after["ttft_limit_ms"]) == (10000, 8000)


def test_a_bad_hour_is_marked_and_nothing_is_created(client_as, world):
    client = client_as("operator")
    capacity = list(CAPACITY)
    capacity[5] = "2.5"

    response = client.post("/tidal/new/", _post(world, **_hours("capacity", capacity)))

    html = response.content.decode()
    assert response.status_code == 400
    assert "capacity[5]: Must be an integer." in html
    assert (
        'name="capacity_5" value="2.5" inputmode="decimal" aria-label="capacity hour 5" class="bad"'
        in html
    )
    assert not TidalSchedule.objects.exists()
    assert not AuditLog.objects.filter(object_type="schedules.tidalschedule").exists()


def test_other_bad_values_name_their_field(client_as, world):
    client = client_as("operator")
    scenario = case_study()
    scenario["remote"]["instances"] = -1
    cases = [
        ({"timezone": "Mars/Olympus"}, 'data-field="timezone"', "Unknown time zone"),
        ({"local_site": str(world.remote.pk)}, 'data-field="remote_site"', "Must differ"),
        ({"scenario": "{not json"}, 'data-field="scenario"', "Not JSON"),
        ({"scenario": json.dumps(scenario)}, 'data-field="scenario"', "scenario.remote"),
        ({"capacity_3": "999"}, 'data-field="capacity"', "capacity[3]: Must be between 0 and 256"),
        ({"demand_rps_0": "5"}, 'data-field="demand_rps"', "demand_rps[1]: Must be a number."),
        ({"ttft_limit_ms": "0"}, 'data-field="ttft_limit_ms"', "greater than or equal to 1"),
    ]
    for overrides, field, message in cases:
        response = client.post("/tidal/new/", _post(world, **overrides))
        html = response.content.decode()
        assert response.status_code == 400, overrides
        assert field in html, overrides
        assert message in html, overrides
    assert not TidalSchedule.objects.exists()


def test_one_schedule_per_deployment_is_named_on_the_deployment(client_as, tidal):  # noqa: F811
    response = client_as("operator").post("/tidal/new/", _post(tidal))

    assert response.status_code == 400
    assert 'data-field="deployment"' in response.content.decode()
    assert TidalSchedule.objects.count() == 1


def test_operator_saves_a_sites_prices_in_place(client_as, world):
    client = client_as("operator")
    prices = [0.8] * 8 + [2.0] * 16

    page = client.get("/tidal/prices/").content.decode()
    response = client.post(
        f"/tidal/prices/{world.remote.pk}/",
        {
            **_hours(f"site{world.remote.pk}-gpu_hour_prices", prices),
            f"site{world.remote.pk}-kw_per_gpu": "0.7",
        },
        HTTP_HX_REQUEST="true",
    )

    assert page.count(f'name="site{world.remote.pk}-gpu_hour_prices_') == 24
    html = response.content.decode()
    assert response.status_code == 200
    assert f'id="prices-{world.remote.pk}"' in html
    assert "<!doctype" not in html  # a fragment, swapped in place
    assert ">saved</span>" in html
    table = SitePriceTable.objects.get(site=world.remote)
    assert (table.gpu_hour_prices, table.energy_prices_kwh, table.kw_per_gpu) == (prices, [], 0.7)
    entry = AuditLog.objects.get(object_type="schedules.sitepricetable")
    assert (entry.action, entry.actor) == ("create", response.wsgi_request.user)

    again = client.post(
        f"/tidal/prices/{world.remote.pk}/",
        {
            **_hours(f"site{world.remote.pk}-gpu_hour_prices", [1.0] * 24),
            f"site{world.remote.pk}-kw_per_gpu": "0",
        },
    )
    assert again.status_code == 302  # without htmx: back to the page
    table.refresh_from_db()
    assert table.gpu_hour_prices == [1.0] * 24
    assert (
        AuditLog.objects.filter(object_type="schedules.sitepricetable").latest("id").action
        == "update"
    )


def test_a_bad_price_hour_is_marked_in_the_fragment_and_nothing_changes(client_as, world):
    price_table_create(actor=None, site=world.remote, gpu_hour_prices=REMOTE_PRICES)
    prices: list[Any] = list(REMOTE_PRICES)
    prices[7] = "cheap"
    before = AuditLog.objects.count()

    response = client_as("operator").post(
        f"/tidal/prices/{world.remote.pk}/",
        {
            **_hours(f"site{world.remote.pk}-gpu_hour_prices", prices),
            f"site{world.remote.pk}-kw_per_gpu": "0",
        },
        HTTP_HX_REQUEST="true",
    )

    html = response.content.decode()
    assert response.status_code == 400  # base.html lets htmx swap it in
    assert "gpu_hour_prices[7]: Must be a number." in html
    assert f'name="site{world.remote.pk}-gpu_hour_prices_7" value="cheap"' in html
    assert SitePriceTable.objects.get(site=world.remote).gpu_hour_prices == REMOTE_PRICES
    assert AuditLog.objects.count() == before


def test_viewer_sees_no_form_and_a_crafted_post_is_refused(client_as, tidal):  # noqa: F811
    schedule = tidal.schedule
    viewer = client_as("viewer")

    listing = viewer.get("/tidal/").content.decode()
    detail = viewer.get(f"/tidal/{schedule.pk}/").content.decode()
    prices = viewer.get("/tidal/prices/").content.decode()

    assert "New tidal schedule" not in listing
    assert "/edit/" not in detail
    assert 'href="/tidal/prices/"' in detail
    assert "gpu_hour_prices_" not in prices  # read only
    assert '<td class="num">6.0</td>' in prices  # the tide shown
    assert viewer.get("/tidal/new/").status_code == 403
    assert viewer.get(f"/tidal/{schedule.pk}/edit/").status_code == 403
    assert viewer.post("/tidal/new/", _post(tidal)).status_code == 403
    assert (
        viewer.post(f"/tidal/{schedule.pk}/edit/", _post(tidal, ttft_limit_ms="1")).status_code
        == 403
    )
    refused = viewer.post(
        f"/tidal/prices/{tidal.local.pk}/",
        _hours(f"site{tidal.local.pk}-gpu_hour_prices", [9] * 24),
    )
    assert refused.status_code == 403
    schedule.refresh_from_db()
    assert schedule.ttft_limit_ms == 10_000
    assert not SitePriceTable.objects.filter(site=tidal.local).exists()
