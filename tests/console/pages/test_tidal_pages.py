"""The tidal pages: empty and with a schedule (the PrfaaS case study with a day/night price
tide, ``tests/console/schedules/conftest.py``), the plan and costs against what the what-if
API answers, a schedule that cannot plan, role gates and bounded queries."""

from __future__ import annotations

from console.schedules.models import TidalSchedule
from tests.console.pages.test_render import MAX_QUERIES
from tests.console.schedules.conftest import (  # noqa: F401  (tidal: a fixture)
    REMOTE_PRICES,
    serve_last_hours,
    tidal,
)


def test_tidal_list_empty(client_as, db, django_assert_max_num_queries):
    client = client_as("viewer")
    with django_assert_max_num_queries(MAX_QUERIES):
        html = client.get("/tidal/").content.decode()

    assert "No tidal schedule" in html


def test_tidal_list_links_the_schedule_and_deployment_link_redirects(client_as, tidal):  # noqa: F811
    client = client_as("viewer")
    schedule = tidal.schedule

    listing = client.get("/tidal/").content.decode()
    redirect = client.get(f"/tidal/?deployment={tidal.deployment.pk}")
    deployment = client.get(f"/deployments/{tidal.deployment.pk}/").content.decode()

    assert f'href="/tidal/{schedule.pk}/"' in listing
    assert redirect.status_code == 302
    assert redirect["Location"] == f"/tidal/{schedule.pk}/"
    assert f'href="/tidal/?deployment={tidal.deployment.pk}"' in deployment
    assert 'href="/tidal/"' in deployment  # nav


def test_unknown_deployment_has_no_schedule(client_as, db):
    html = client_as("viewer").get("/tidal/?deployment=999999").content.decode()

    assert "No tidal schedule for this deployment" in html


def test_tidal_page_shows_prices_plan_and_costs_from_the_what_if_service(
    client_as,
    api_as,
    tidal,  # noqa: F811
    django_assert_max_num_queries,
):
    schedule = tidal.schedule
    what_if = api_as("viewer").get(f"/api/tidal-schedules/{schedule.pk}/what-if/").json()
    client = client_as("viewer")

    with django_assert_max_num_queries(MAX_QUERIES):
        response = client.get(f"/tidal/{schedule.pk}/")
    html = response.content.decode()

    assert response.status_code == 200
    assert html.count("plotly-graph-div") == 3  # prices, plan, cost by hour
    assert "remote share of requests %" in html
    assert str(max(REMOTE_PRICES)) in html  # the peak price is charted
    for key in ("tidal", "all_local", "always_remote"):
        cost = what_if["totals"][key]["cost_per_million_tokens"]
        assert f"{cost:.4f}" in html, key
    instances = [h["remote_instances"] for h in what_if["hours"]]
    assert f'"y":[{",".join(str(i) for i in instances)}]' in html  # the bars are the plan


def test_a_schedule_that_cannot_plan_names_the_field(client_as, tidal):  # noqa: F811
    TidalSchedule.objects.filter(pk=tidal.schedule.pk).update(capacity=[1, 2])

    response = client_as("viewer").get(f"/tidal/{tidal.schedule.pk}/")

    assert response.status_code == 200
    assert 'id="tidal-error"' in response.content.decode()
    assert "capacity" in response.content.decode()


def test_tidal_pages_need_a_role(client, client_as, tidal):  # noqa: F811
    url = f"/tidal/{tidal.schedule.pk}/"
    assert client.get(url).status_code == 302
    assert client_as(None).get(url).status_code == 403
    assert client_as("viewer").get("/tidal/999999/").status_code == 404


def test_tidal_page_prices_the_recorded_traffic_with_and_without_the_schedule(
    client_as,
    api_as,
    tidal,  # noqa: F811
    django_assert_max_num_queries,
):
    serve_last_hours(tidal)
    schedule = tidal.schedule
    api = api_as("viewer").get(f"/api/tidal-schedules/{schedule.pk}/recorded-cost/").json()
    client = client_as("viewer")

    with django_assert_max_num_queries(MAX_QUERIES):
        response = client.get(f"/tidal/{schedule.pk}/")
    html = response.content.decode()

    assert response.status_code == 200
    assert html.count("plotly-graph-div") == 4  # prices, plan, cost by hour, recorded cost
    assert 'id="recorded-totals"' in html
    for key in ("scheduled", "static"):
        cost = api["totals"][key]["cost_per_million_tokens"]
        assert f"{cost:.4f}" in html, key
    assert "3 h applied" in html
    assert "3 hours with traffic; 165 without a sample" in html
    assert f'href="/planner/?tidal={schedule.pk}&amp;days=7#tidal-recorded"' in html
    assert '"connectgaps":false' in html
    assert "null" in html  # the hours without a sample are gaps in the lines


def test_tidal_page_without_recorded_traffic_says_so(client_as, tidal):  # noqa: F811
    html = client_as("viewer").get(f"/tidal/{tidal.schedule.pk}/").content.decode()

    assert 'id="recorded-empty"' in html
    assert "No recorded traffic in the last 7 days" in html
    assert html.count("plotly-graph-div") == 3  # no chart for nothing
    assert 'id="recorded-totals"' not in html


def test_tidal_page_days_choice_and_a_bad_days_named(client_as, tidal):  # noqa: F811
    client = client_as("viewer")

    one = client.get(f"/tidal/{tidal.schedule.pk}/?days=1").content.decode()
    bad = client.get(f"/tidal/{tidal.schedule.pk}/?days=99")

    assert "Last 1 day " in one
    assert bad.status_code == 400
    assert 'id="recorded-error"' in bad.content.decode()
    assert "days: must be a whole number from 1 to 31" in bad.content.decode()
