"""The drills list and the drill report page: empty and with data, the report's figures as
the drill workflow computes them (``drill_figures.figures`` on generated load records), role
gates and bounded queries."""

from __future__ import annotations

import pytest

from console.drills import services
from console.drills.charts import bucket_counts
from console.drills.models import Drill, DrillReport
from orchestrator.workflows.drill_figures import figures
from tests.console.pages.test_render import MAX_QUERIES


def _records(n: int = 600) -> list[dict]:
    """A drill's load: remote before t=20, fallback (and two failures) while the link is cut
    (20..40), remote again from 42; one request every 0.1 s from t=0."""
    rows = []
    for i in range(n):
        start = 1000.0 + i * 0.1
        t = start - 1000.0
        path = "fallback" if 20 <= t < 42 else "remote"
        outcome = "error" if i in (201, 202) else "ok"
        rows.append({
            "start": start, "path": path if outcome == "ok" else None, "outcome": outcome,
            "status": 200 if outcome == "ok" else 502, "error": "" if outcome == "ok" else "cut",
            "ttft_s": (0.4 if path == "fallback" else 0.1) if outcome == "ok" else None,
            "total_s": 0.5, "prompt_tokens": 4096,
        })  # fmt: skip
    return rows


@pytest.fixture
def drill(world):
    return services.drill_create(
        actor=None,
        name="cut",
        deployment=world.deployment,
        kind="link_cut",
        criteria={"max_failed_requests": 0},
    )


def run_and_complete(drill: Drill) -> DrillReport:
    """Start ``drill`` and complete its report with the figures the workflow computes from
    ``_records()`` (the link cut from t=20 to t=40)."""
    report = services.drill_run(actor=None, drill=drill)
    figs = figures(
        _records(),
        load_started_at=1000.0,
        injected_at=1020.0,
        restored_at=1040.0,
        breaker={"ejections": 1},
        verification={"prompts": [{"tokens": 64, "match": True, "first_divergent_token": None}]},
    )
    return services.drill_report_complete(run_id=report.run_id, figures=figs)


@pytest.fixture
def finished_report(drill):
    return run_and_complete(drill)


def test_drill_list_empty_says_how_to_create_one(client_as, world, django_assert_max_num_queries):
    client = client_as("viewer")
    with django_assert_max_num_queries(MAX_QUERIES):
        response = client.get("/drills/")

    assert response.status_code == 200
    assert "No drills" in response.content.decode()


def test_drill_list_per_deployment_links_reports_and_shows_run_button_to_operators(
    client_as, world, finished_report, django_assert_max_num_queries
):
    for _ in range(30):  # more reports do not mean more queries
        DrillReport.objects.create(drill=finished_report.drill, kind="link_cut", state="aborted")
    url = f"/drills/?deployment={world.deployment.pk}"

    client = client_as("viewer")
    with django_assert_max_num_queries(MAX_QUERIES):
        viewer = client.get(url).content.decode()
    operator = client_as("operator").get(url).content.decode()

    assert f"/drills/reports/{finished_report.pk}/" not in viewer  # only the five latest
    assert viewer.count("/drills/reports/") == 5
    assert "Run drill" not in viewer
    assert f'hx-post="/api/drills/{finished_report.drill.pk}/run/"' in operator


def test_drill_list_of_an_unknown_deployment_is_404(client_as, drill):
    response = client_as("viewer").get(f"/drills/?deployment={drill.deployment.pk + 1000}")

    assert response.status_code == 404


def test_run_button_starts_the_drill_through_the_api(client_as, drill):
    client = client_as("operator")
    response = client.post(f"/api/drills/{drill.pk}/run/")

    assert response.status_code == 202
    assert DrillReport.objects.filter(drill=drill, state="running").count() == 1


def test_the_run_button_answers_a_toast_linking_the_report_and_a_refusal_in_words(client_as, drill):
    client = client_as("operator")

    started = client.post(f"/api/drills/{drill.pk}/run/", HTTP_HX_REQUEST="true")
    refused = client.post(f"/api/drills/{drill.pk}/run/", HTTP_HX_REQUEST="true")

    report = DrillReport.objects.get(drill=drill)
    assert started.status_code == 202
    assert started["Content-Type"].startswith("text/html")
    toast = started.content.decode()
    assert f"Drill {drill.name} started: report #{report.pk}." in toast
    assert f'href="/drills/reports/{report.pk}/"' in toast
    assert f'href="/runs/{report.run_id}/"' in toast
    assert "{" not in toast  # no JSON in the page
    assert started["HX-Trigger"] == "pdbridge-run-changed"
    assert refused.status_code == 409
    assert "Refused (409):" in refused.content.decode()
    assert "HX-Trigger" not in refused


def test_report_page_shows_verdict_chart_ttft_times_and_criteria(
    client_as, finished_report, django_assert_max_num_queries
):
    client = client_as("viewer")
    with django_assert_max_num_queries(MAX_QUERIES):
        response = client.get(f"/drills/reports/{finished_report.pk}/")
    html = response.content.decode()

    assert response.status_code == 200
    assert finished_report.state == "failed"  # two failed requests, limit 0
    assert 'id="verdict">failed' in html
    assert "max_failed_requests" in html
    assert "plotly-graph-div" in html
    assert '"fillcolor":"#cf222e"' in html  # the shaded fault window
    assert "Time to detect" in html
    assert f"{finished_report.time_to_recover_s:.3f} s" in html
    assert "fallback" in html
    assert "during p50" in html
    assert "first_divergent_token" in html  # verification table


def test_running_report_renders_without_figures(client_as, drill):
    report = services.drill_run(actor=None, drill=drill)

    html = client_as("viewer").get(f"/drills/reports/{report.pk}/").content.decode()

    assert "The drill is running" in html
    assert "No data yet" in html


@pytest.mark.parametrize("url", ["/drills/", "/drills/reports/{r}/"])
def test_drill_pages_need_a_role(client, client_as, finished_report, url):
    url = url.format(r=finished_report.pk)
    assert client.get(url).status_code == 302  # the login page
    assert client_as(None).get(url).status_code == 403


def test_missing_report_is_404(client_as, db):
    assert client_as("viewer").get("/drills/reports/999999/").status_code == 404


def test_timeline_buckets_count_every_request_once(finished_report):
    _, series = bucket_counts(finished_report.timeline)
    width, _ = bucket_counts(finished_report.timeline)

    total = sum(rate * width for points in series.values() for _, rate in points)
    assert round(total) == finished_report.total_requests
    assert set(series) == {"remote", "fallback", "failed"}


def test_deployment_page_links_its_drills_and_nav_lists_drills(client_as, world):
    html = client_as("viewer").get(f"/deployments/{world.deployment.pk}/").content.decode()

    assert f'href="/drills/?deployment={world.deployment.pk}"' in html
    assert 'href="/drills/"' in html
