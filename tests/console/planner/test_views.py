import json

import pytest

from console.planner.presets import preset_scenario
from tests.console.schedules.conftest import serve_last_hours, tidal  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db

PAGE = "/planner/"


@pytest.fixture
def logged_in(client, make_user):
    def login(role):
        client.force_login(make_user(role))
        return client

    return login


def test_anonymous_is_sent_to_login(client):
    response = client.get(PAGE)

    assert response.status_code == 302
    assert "/login/" in response["Location"]


def test_user_without_a_role_is_refused(logged_in):
    assert logged_in(None).get(PAGE).status_code == 403


def test_page_shows_the_case_study_verdict_optimum_and_charts(logged_in):
    response = logged_in("viewer").get(PAGE)

    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="verdict"' in html
    assert "Offload" in html
    assert "3 / 5" in html  # the split
    assert "3.247 req/s" in html
    assert "2.110 req/s" in html  # homogeneous baseline
    assert html.count("plotly-graph-div") == 2
    assert "/assets/plotly.min.js" in html


def test_posted_scenario_is_evaluated(logged_in):
    body = preset_scenario("prfaas-case-study")
    body["link"]["bandwidth_gbps"] = 5

    response = logged_in("viewer").post(PAGE, {"body": json.dumps(body)})

    assert response.status_code == 200
    assert "Thin link" in response.content.decode()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "body: not valid JSON"),
        ('{"lengths": 1}', "lengths: must be an object"),
        ("[]", "must be an object"),
        ('{"kv": {"model": 99999}}', "kv.model: no model with id 99999"),
    ],
)
def test_bad_scenario_is_an_error_on_the_page(logged_in, text, message):
    response = logged_in("viewer").post(PAGE, {"body": text})

    assert response.status_code == 400
    assert message in response.content.decode()
    assert "plotly-graph-div" not in response.content.decode()


def test_saved_scenario_and_unknown_preset(logged_in, api_as):
    created = api_as("operator").post(
        "/api/planner/scenarios/", {"name": "thin", "body": preset_scenario("prfaas-case-study")}
    )
    client = logged_in("viewer")

    saved = client.get(PAGE, {"scenario": created.json()["id"]})
    unknown = client.get(PAGE, {"preset": "nope", "scenario": "abc"})

    assert saved.status_code == 200
    assert "saved scenario thin" in saved.content.decode()
    assert unknown.status_code == 200  # falls back to the case study


def test_plotly_js_is_served_locally_compressed_and_cached(client):
    import gzip

    plain = client.get("/assets/plotly.min.js")
    packed = client.get("/assets/plotly.min.js", HTTP_ACCEPT_ENCODING="gzip, br")
    again = client.get("/assets/plotly.min.js", HTTP_IF_NONE_MATCH=plain["ETag"])

    assert plain.status_code == 200
    assert plain["Content-Type"] == "application/javascript"
    assert len(plain.content) > 1_000_000
    assert packed["Content-Encoding"] == "gzip"
    assert gzip.decompress(packed.content) == plain.content
    assert len(packed.content) < len(plain.content) / 2
    assert again.status_code == 304
    assert again.content == b""


def test_the_partial_plotly_bundle_is_served_only_for_the_installed_version(client):
    from pathlib import Path

    import plotly

    from console.core.views import PLOTLY_BASIC, plotly_version

    full = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    served = client.get("/assets/plotly.min.js")

    # This environment pins the matching plotly: the quarter-size bundle. A plotly upgrade
    # that moves plotly.js on falls back to the full bundle until the vendored one follows.
    assert plotly_version(full) == plotly_version(PLOTLY_BASIC.read_bytes()) == "4.1.1"
    assert served["X-Plotly-Bundle"] == "basic"
    assert len(served.content) < len(full) / 3


# --- the recorded cost of a tidal schedule -------------------------------------------------


def test_planner_page_without_a_tidal_schedule_says_how_to_get_one(logged_in):
    html = logged_in("viewer").get(PAGE).content.decode()

    assert 'id="tidal-recorded-none"' in html
    assert 'href="/tidal/new/"' in html


def test_planner_page_shows_a_schedules_recorded_cost_with_and_without_it(
    logged_in,
    api_as,
    tidal,  # noqa: F811
    django_assert_max_num_queries,
):
    serve_last_hours(tidal)
    schedule = tidal.schedule
    api = api_as("viewer").get(f"/api/tidal-schedules/{schedule.pk}/recorded-cost/?days=1").json()
    client = logged_in("viewer")

    with django_assert_max_num_queries(24):  # the planner's own, plus one schedule's section
        response = client.get(f"{PAGE}?tidal={schedule.pk}&days=1")
    html = response.content.decode()

    assert response.status_code == 200
    assert 'id="tidal-recorded"' in html
    for key in ("scheduled", "static"):
        cost = api["totals"][key]["cost_per_million_tokens"]
        assert f"{cost:.4f}" in html, key
    assert f'href="/tidal/{schedule.pk}/#recorded-cost"' in html
    assert f'href="?tidal={schedule.pk}&amp;days=7#recorded-cost"' in html
    assert html.count("plotly-graph-div") == 3  # threshold, split, recorded cost


def test_planner_page_bad_days_is_named(logged_in, tidal):  # noqa: F811
    response = logged_in("viewer").get(f"{PAGE}?days=0")

    assert response.status_code == 400
    assert "days: must be a whole number from 1 to 31" in response.content.decode()
