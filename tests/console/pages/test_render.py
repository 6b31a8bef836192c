"""Every page renders for every role that may read it, with no data and with a few thousand
runs and samples, in a bounded number of queries that does not grow with the data."""

from __future__ import annotations

import re

import pytest

from console.telemetry.models import MetricSample
from tests.console.pages.conftest import add_runs, add_samples

# Queries per page, whatever the amount of data (sessions, user, role, the page's reads; the
# deployment page, the largest, reads its pools' drained nodes, rebalancing proposals and the
# canary in progress too).
MAX_QUERIES = 19


def _render_all(client, pages, django_assert_max_num_queries):
    for name, url in pages.urls().items():
        with django_assert_max_num_queries(MAX_QUERIES):
            response = client.get(url)
        assert response.status_code == 200, (name, response.status_code)
        assert b"Traceback" not in response.content
        yield name, response.content.decode()


def test_every_page_renders_with_empty_history(client_as, pages, django_assert_max_num_queries):
    client = client_as("viewer")

    html = dict(_render_all(client, pages, django_assert_max_num_queries))

    assert "No data yet" in html["deployment"]  # charts say what fills them
    assert "No data yet" in html["link"]
    assert "no traffic recorded" in html["overview"]
    assert "plotly-graph-div" in html["model"]  # the KV chart needs no history


def test_list_pages_with_nothing_say_what_to_do(client_as, db, django_assert_max_num_queries):
    client = client_as("viewer")
    for url, hint in [
        ("/", "No sites yet"),
        ("/sites/", "No sites yet"),
        ("/models/", "No models"),
        ("/deployments/", "No deployments"),
        ("/runs/", "No runs"),
        ("/security/", "No nodes registered"),
    ]:
        with django_assert_max_num_queries(MAX_QUERIES):
            response = client.get(url)
        assert response.status_code == 200
        assert hint in response.content.decode(), url


def test_every_page_renders_with_thousands_of_runs_and_samples(
    client_as, pages, django_assert_max_num_queries
):
    add_runs(3000, target=pages.world.deployment)
    samples = add_samples(pages.world, per_series=200)
    assert samples == MetricSample.objects.count() >= 3000
    client = client_as("viewer")

    html = dict(_render_all(client, pages, django_assert_max_num_queries))

    assert html["deployment"].count("plotly-graph-div") >= 5  # ttft, tpot, success, threshold, link
    assert html["link"].count("plotly-graph-div") == 3
    assert html["node"].count("plotly-graph-div") == 2
    assert html["site"].count("plotly-graph-div") == 1
    assert "remote 33 %" in html["overview"]  # equal traffic on the three paths
    assert "page 1 of 61" in html["runs"]  # 3001 runs, 50 a page


def test_run_list_paginates_and_filters(client_as, pages):
    add_runs(120)
    client = client_as("viewer")

    last = client.get("/runs/?page=3").content.decode()
    failed = client.get("/runs/?state=failed").content.decode()
    beyond = client.get("/runs/?page=999")

    assert "page 3 of 3" in last
    assert len(re.findall(r'href="/runs/\d+/"', last)) == 21  # 121 runs: 50 + 50 + 21
    assert "page 1 of 1" not in failed
    assert "selfcheck" in failed
    assert failed.count('class="badge bad">failed') == 24
    assert beyond.status_code == 200  # the last page, not an error


def test_audit_log_paginates(client_as, pages):
    client = client_as("viewer")
    from console.deployments.services import deployment_set_kill_switch

    for i in range(60):
        deployment_set_kill_switch(
            actor=None, deployment=pages.world.deployment, enabled=i % 2 == 0
        )

    first = client.get("/audit/?verb=kill_switch").content.decode()

    assert "page 1 of 2 (60 in all)" in first
    assert f'href="/deployments/{pages.world.deployment.pk}/"' in first  # entries link to pages


def test_pages_need_login_and_a_role(client, client_as, pages):
    no_role = client_as(None)
    for url in pages.urls().values():
        assert client.get(url).status_code == 302
        assert no_role.get(url).status_code == 403


@pytest.mark.parametrize("url", ["/sites/999999/", "/deployments/999999/", "/runs/999999/"])
def test_missing_objects_are_404(client_as, db, url):
    assert client_as("viewer").get(url).status_code == 404
