"""The report pages in a real browser: a viewer opens a drill report (figures computed by the
drill workflow's own ``drill_figures.figures``), a canary and a tidal plan, and plotly draws
each chart with data (the drill timeline's traces and its shaded fault window). Screenshots go
to ``var/screenshots/``."""

from __future__ import annotations

import pytest

from console.deployments import flows
from console.drills import services as drill_services
from tests.console.pages.test_drill_pages import run_and_complete
from tests.console.schedules.conftest import tidal  # noqa: F401  (a fixture)
from tests.e2e.test_console_browser import _chart_points, _login

pytestmark = pytest.mark.django_db(transaction=True)


def test_viewer_sees_drill_report_canary_and_tidal_charts(
    browser,
    live_server,
    make_user,
    tidal,  # noqa: F811
    screenshots,
):
    drill = drill_services.drill_create(
        actor=None, name="cut", deployment=tidal.deployment, kind="link_cut"
    )
    report = run_and_complete(drill)
    canary = flows.canary_start(actor=None, deployment=tidal.deployment)
    make_user("viewer", username="viewer")
    base = live_server.url
    page = _login(browser, base, "viewer")

    page.goto(f"{base}/drills/reports/{report.pk}/")
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=20_000)
    traces = page.locator(".js-plotly-plot .scatterlayer .trace").count()
    shaded = page.locator(".js-plotly-plot .shapelayer path").count()
    page.screenshot(path=str(screenshots / "drill-report.png"), full_page=True)
    page.goto(f"{base}/canaries/{canary.pk}/")
    canary_buttons = page.locator("#canary-actions").count()
    page.screenshot(path=str(screenshots / "canary.png"), full_page=True)
    page.goto(f"{base}/tidal/{tidal.schedule.pk}/")
    tidal_points = _chart_points(page)
    tidal_charts = page.locator(".js-plotly-plot").count()
    page.screenshot(path=str(screenshots / "tidal.png"), full_page=True)

    assert traces == 3  # remote, fallback, failed
    assert shaded >= 1  # the fault window (and the recovery line)
    assert canary_buttons == 0  # a viewer
    assert tidal_points > 0
    assert tidal_charts == 3
    page.context.close()


def test_viewer_sees_the_recorded_cost_with_and_without_the_schedule(
    browser,
    live_server,
    make_user,
    tidal,  # noqa: F811
    screenshots,
):
    from tests.console.schedules.conftest import serve_last_hours

    serve_last_hours(tidal, hours=5)
    make_user("viewer", username="viewer")
    base = live_server.url
    page = _login(browser, base, "viewer")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    page.goto(f"{base}/tidal/{tidal.schedule.pk}/?days=1#recorded-cost")
    recorded = page.locator(".js-plotly-plot").nth(3)  # after prices, plan, cost by hour
    recorded.locator(".main-svg").first.wait_for(timeout=20_000)
    lines = recorded.locator(".scatterlayer .trace").count()
    bars = recorded.locator(".barlayer .point").count()
    totals = page.locator("#recorded-totals tbody tr").count()
    page.locator("#recorded-cost").scroll_into_view_if_needed()
    page.screenshot(path=str(screenshots / "tidal-recorded-cost.png"), full_page=True)
    page.click("#planner-link")
    page.wait_for_selector("#tidal-recorded .js-plotly-plot .main-svg", timeout=20_000)
    planner_title = page.locator("#tidal-recorded .gtitle").text_content() or ""
    page.locator("#tidal-recorded").screenshot(path=str(screenshots / "planner-recorded-cost.png"))

    assert errors == []
    assert page.locator(".js-plotly-plot").count() == 3  # threshold, split, recorded cost
    assert lines == 2  # with and without the schedule
    assert bars == 24  # remote instances held, one bar per hour of the day (0 included)
    assert totals == 3  # with, without, saving
    assert " with, " in planner_title
    assert planner_title.endswith(" without")
    page.context.close()
