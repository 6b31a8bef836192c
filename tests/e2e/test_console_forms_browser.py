"""The forms as an operator fills them in a real browser: a drill (a bad schedule first,
named on its input, then fixed), a rollout plan whose steps are removed and added in place
with htmx, a site's 24 hourly prices saved in place, and a tidal schedule whose plan the page
then draws; on the alerts page a rule (a bad metric named first) and a webhook channel, shown
masked. Each asserts what the page shows afterwards; screenshots go to ``var/screenshots/``."""

from __future__ import annotations

import re
from typing import Any

import pytest

from console.alerts.models import AlertRule, NotificationChannel
from console.core.models import AuditLog
from console.drills.models import Drill
from console.rollouts.models import RolloutPlan
from console.schedules.models import SitePriceTable, TidalSchedule
from console.schedules.services import tidal_what_if
from tests.e2e.test_console_browser import _login

pytestmark = pytest.mark.django_db(transaction=True)


def test_operator_creates_a_drill_a_rollout_plan_and_a_tidal_schedule(
    browser: Any, live_server: Any, make_user: Any, world: Any, screenshots: Any
) -> None:
    make_user("operator", username="operator")
    base = live_server.url
    dep = world.deployment
    world.local.gpu_hour_price = 1.5  # flat; the remote site gets a day/night table below
    world.local.save()
    page = _login(browser, base, "operator")

    # A drill: the list's button, a bad schedule named on its input, then saved.
    page.goto(f"{base}/drills/?deployment={dep.pk}")
    page.click("#drill-new")
    page.wait_for_url(re.compile(r"/drills/new/"))
    assert page.input_value("#id_deployment") == str(dep.pk)
    page.fill("#id_name", "cut-west")
    page.select_option("#id_kind", "remote_restart")
    page.fill("#id_fault_s", "40")
    page.fill("#id_schedule", "every night")
    page.uncheck("#id_criteria_require_verification")
    page.click("#drill-form button[type=submit]")
    page.wait_for_selector("#field-schedule .field-error")
    assert "five fields expected" in page.inner_text("#field-schedule")
    assert page.input_value("#id_name") == "cut-west"  # what was typed stays
    assert not Drill.objects.exists()
    page.screenshot(path=str(screenshots / "drill-form-error.png"), full_page=True)
    page.fill("#id_schedule", "30 2 * * *")
    page.click("#drill-form button[type=submit]")
    page.wait_for_url(re.compile(r"/drills/\d+/$"))
    drill = Drill.objects.get(name="cut-west")
    assert page.url == f"{base}/drills/{drill.pk}/"
    assert "Drill cut-west created." in page.inner_text(".messages")
    definition = page.inner_text("#drill-definition")
    assert "Remote restart" in definition
    assert "40 s" in definition
    assert "30 2 * * *" in definition
    assert "require_verification\tFalse" in page.inner_text("#drill-criteria")
    page.screenshot(path=str(screenshots / "drill-created.png"), full_page=True)

    # A rollout plan from the deployment page: two steps removed, two added with htmx.
    page.goto(f"{base}/deployments/{dep.pk}/")
    page.click("#rollout-link")
    page.click("#plan-new")
    page.wait_for_url(re.compile(r"/rollouts/new/"))
    page.fill("#id_name", "careful-west")
    rows = page.locator("#steps-body tr")
    assert rows.count() == 4  # the guide's 1 -> 10 -> 50 -> 100 to start from
    rows.nth(3).locator("button.remove-step").click()
    rows.nth(2).locator("button.remove-step").click()
    assert rows.count() == 2
    for share, duration, requests in (("25", "600", "3000"), ("100", "0", "0")):
        # Counted before the click: htmx may have added the row by the time it returns.
        expected = rows.count() + 1
        page.click("#add-step")
        page.wait_for_function(f"document.querySelectorAll('#steps-body tr').length == {expected}")
        row = rows.last
        row.locator("input[name=step_share_percent]").fill(share)
        row.locator("input[name=step_min_duration_s]").fill(duration)
        row.locator("input[name=step_min_requests]").fill(requests)
    page.fill("#id_gate_ttft_p50_ratio", "1.15")
    page.fill("#id_gate_link_utilization_max", "0.6")
    page.screenshot(path=str(screenshots / "rollout-form.png"), full_page=True)
    page.click("#plan-form button[type=submit]")
    page.wait_for_url(re.compile(r"/rollouts/\d+/$"))
    plan = RolloutPlan.objects.get(name="careful-west")
    assert [s["share_percent"] for s in plan.steps] == [1, 10, 25, 100]
    assert "Rollout plan careful-west created." in page.inner_text(".messages")
    steps = page.inner_text("#plan-steps")
    assert "25 %\t600 s\t3000" in steps
    assert "1.15 \N{MULTIPLICATION SIGN}" in page.inner_text("#plan-gates")
    assert dep.name in page.inner_text("#plan-users")
    page.screenshot(path=str(screenshots / "rollout-plan.png"), full_page=True)
    page.goto(f"{base}/rollouts/")
    assert "1 → 10 → 25 → 100 %" in page.inner_text("#rollout-plans")

    # The remote site's 24 prices, saved in place (no page load: the card is swapped).
    page.goto(f"{base}/tidal/prices/")
    card = f"#prices-{world.remote.pk}"
    for hour in range(24):
        price = "0.5" if hour < 8 else "2.5"
        page.fill(f"{card} input[name=site{world.remote.pk}-gpu_hour_prices_{hour}]", price)
    page.fill(f"{card} input[name=site{world.remote.pk}-gpu_hour_prices_3]", "cheap")
    page.evaluate("window.__same_page = true")
    page.click(f"{card} button[type=submit]")
    page.wait_for_selector(f"{card} .field-error")
    assert "gpu_hour_prices[3]: Must be a number." in page.inner_text(card)
    page.fill(f"{card} input[name=site{world.remote.pk}-gpu_hour_prices_3]", "0.5")
    page.click(f"{card} button[type=submit]")
    page.wait_for_selector(f"{card} .badge.good:has-text('saved')")
    assert page.evaluate("window.__same_page") is True
    assert SitePriceTable.objects.get(site=world.remote).gpu_hour_prices[3] == 0.5
    page.screenshot(path=str(screenshots / "tidal-prices.png"), full_page=True)

    # A tidal schedule, then its plan drawn from the what-if service.
    page.goto(f"{base}/tidal/")
    page.click("#tidal-new")
    page.wait_for_url(re.compile(r"/tidal/new/"))
    page.select_option("#id_deployment", str(dep.pk))
    page.select_option("#id_remote_site", str(world.remote.pk))
    page.select_option("#id_local_site", str(world.local.pk))
    page.fill("#id_ttft_limit_ms", "10000")
    for hour in range(24):
        page.fill(f"input[name=capacity_{hour}]", "2")
    page.click("#tidal-form button[type=submit]")
    page.wait_for_url(re.compile(r"/tidal/\d+/$"), timeout=60_000)
    schedule = TidalSchedule.objects.get(deployment=dep)
    assert schedule.capacity == [2] * 24
    assert f"Tidal schedule of {dep.name} created." in page.inner_text(".messages")
    page.wait_for_function(
        "document.querySelectorAll('.js-plotly-plot').length === 3 && "
        "[...document.querySelectorAll('.js-plotly-plot')].every(p => p.data && p.data.length)",
        timeout=30_000,
    )
    assert page.locator("#tidal-hours tbody tr").count() == 24
    shown = [int(r.split("\t")[1]) for r in page.locator("#tidal-hours tbody tr").all_inner_texts()]
    assert shown == [h["remote_instances"] for h in tidal_what_if(schedule=schedule)["hours"]]
    assert shown[2] == 2  # the remote site is cheap at night: both instances planned
    page.screenshot(path=str(screenshots / "tidal-created.png"), full_page=True)

    actors = set(
        AuditLog.objects.filter(
            object_type__in=[
                "drills.drill",
                "rollouts.rolloutplan",
                "schedules.sitepricetable",
                "schedules.tidalschedule",
            ]
        ).values_list("actor__username", "object_type")
    )
    assert actors == {
        ("operator", "drills.drill"),
        ("operator", "rollouts.rolloutplan"),
        ("operator", "schedules.sitepricetable"),
        ("operator", "schedules.tidalschedule"),
    }
    page.context.close()


def test_operator_adds_an_alert_rule_and_a_channel_on_the_alerts_page(
    browser: Any, live_server: Any, make_user: Any, screenshots: Any
) -> None:
    make_user("operator", username="operator")
    base = live_server.url
    page = _login(browser, base, "operator")

    page.goto(f"{base}/alerts/")
    page.click("#rule-new")
    page.wait_for_url(re.compile(r"/alert-rules/new/"))
    page.fill("#id_name", "kv-queue-high")
    page.fill("#id_metric", "kv queue")
    page.select_option("#id_subject_type", "inventory.node")
    page.select_option("#id_aggregate", "max")
    page.fill("#id_threshold", "1e9")
    page.click("#rule-form button[type=submit]")
    page.wait_for_selector("#field-metric .field-error")
    assert "Prometheus metric name" in page.inner_text("#field-metric")
    page.fill("#id_metric", "kv_link_queue_bytes")
    page.click("#rule-form button[type=submit]")
    page.wait_for_url(re.compile(r"/alerts/#rule-\d+$"))
    rule = AlertRule.objects.get(name="kv-queue-high")
    assert "Rule kv-queue-high created" in page.inner_text(".messages")
    assert "max(kv_link_queue_bytes[300s])" in page.inner_text(f"#rule-{rule.pk}")

    page.click("#channel-new")
    page.wait_for_url(re.compile(r"/alert-channels/new/"))
    page.fill("#id_name", "ops-hook")
    page.fill("#id_target", "https://hooks.example.com/services/s3cr3t")
    page.select_option("#id_min_level", "critical")
    page.click("#channel-form button[type=submit]")
    page.wait_for_url(re.compile(r"/alerts/#channel-\d+$"))
    channel = NotificationChannel.objects.get(name="ops-hook")
    row = page.inner_text(f"#channel-{channel.pk}")
    assert "https://hooks.example.com/… (sha256" in row
    assert "critical" in row
    assert "s3cr3t" not in page.content()
    page.screenshot(path=str(screenshots / "alerts-rule-and-channel.png"), full_page=True)
    page.context.close()
