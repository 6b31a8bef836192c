"""The drill form: an operator creates and edits a drill through the page (the API's
services: the same checks and the same audit entry), a bad value comes back on the field it
names with nothing written, and a viewer sees no form and gets 403 for a crafted POST."""

from __future__ import annotations

from typing import Any

from console.core.models import AuditLog
from console.drills import services
from console.drills.models import Drill


def _post(world: Any, **overrides: Any) -> dict[str, Any]:
    body = {
        "name": "cut-east",
        "deployment": str(world.deployment.pk),
        "kind": "link_cut",
        "fault_s": "45",
        "baseline_s": "20",
        "after_s": "25",
        "recover_timeout_s": "90",
        "schedule": "15 3 * * 1",
        "criteria_max_failed_requests": "2",
        "criteria_max_time_to_detect_s": "5",
        "criteria_max_time_to_recover_s": "60.0",
        "criteria_require_fallback": "on",
        "criteria_require_breaker_open": "on",
        "criteria_require_recovery": "on",
        # require_verification unchecked: off
        "target_verify_prompts": "64, 512",
        "load_concurrency": "8",
    }
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not None}


def test_operator_creates_a_drill_and_lands_on_its_page(client_as, world):
    client = client_as("operator")

    form = client.get(f"/drills/new/?deployment={world.deployment.pk}")
    response = client.post("/drills/new/", _post(world))

    assert form.status_code == 200
    assert f'<option value="{world.deployment.pk}" selected>' in form.content.decode()
    drill = Drill.objects.get(name="cut-east")
    assert response.status_code == 302
    assert response["Location"] == f"/drills/{drill.pk}/"
    assert (drill.kind, drill.fault_s, drill.baseline_s, drill.after_s) == ("link_cut", 45, 20, 25)
    assert drill.recover_timeout_s == 90
    assert drill.schedule == "15 3 * * 1"
    assert drill.periodic_task is not None  # the schedule went to beat, as through the API
    # Only what differs from the defaults is stated.
    assert drill.criteria == {
        "max_failed_requests": 2,
        "max_time_to_detect_s": 5.0,
        "require_verification": False,
    }
    assert drill.targets == {"verify_prompts": [64, 512]}
    assert drill.load_profile == {"concurrency": 8}
    page = client.get(response["Location"]).content.decode()
    assert "Drill cut-east created." in page
    assert "<code>15 3 * * 1</code>" in page
    entry = AuditLog.objects.get(object_type="drills.drill", object_id=str(drill.pk))
    assert (entry.action, entry.actor.username) == ("create", response.wsgi_request.user.username)


def test_operator_edits_a_drill(client_as, world):
    drill = services.drill_create(
        actor=None, name="cut", deployment=world.deployment, kind="link_cut", criteria={}
    )
    client = client_as("operator")

    form = client.get(f"/drills/{drill.pk}/edit/").content.decode()
    response = client.post(
        f"/drills/{drill.pk}/edit/",
        _post(world, name="cut", kind="remote_restart", schedule="", target_verify_prompts=""),
    )

    assert 'value="cut"' in form
    assert response.status_code == 302
    assert response["Location"] == f"/drills/{drill.pk}/"
    drill.refresh_from_db()
    assert (drill.kind, drill.fault_s) == ("remote_restart", 45)
    assert drill.periodic_task is None
    entry = AuditLog.objects.filter(object_type="drills.drill", object_id=str(drill.pk)).latest(
        "id"
    )
    assert entry.action == "update"
    assert entry.before["kind"] == "link_cut"
    assert entry.after["kind"] == "remote_restart"
    assert "Drill cut saved." in client.get(response["Location"]).content.decode()


def test_saving_an_untouched_edit_form_keeps_the_stated_criteria(client_as, world):
    drill = services.drill_create(
        actor=None,
        name="cut",
        deployment=world.deployment,
        kind="link_cut",
        criteria={"max_failed_requests": 0},
    )
    client = client_as("operator")
    html = client.get(f"/drills/{drill.pk}/edit/").content.decode()
    # Its default depends on the drill's target (every site: on, one site: off): "default".
    fallback = html.split('name="criteria_require_fallback"', 1)[1].split("</select>", 1)[0]
    assert '<option value="" selected>default</option>' in fallback

    body = {
        "name": "cut", "deployment": str(world.deployment.pk), "kind": "link_cut",
        "fault_s": "60.0", "baseline_s": "30.0", "after_s": "30.0", "recover_timeout_s": "120.0",
        "schedule": "", "criteria_max_failed_requests": "0", "criteria_max_time_to_detect_s": "",
        "criteria_max_time_to_recover_s": "60.0", "criteria_require_fallback": "on",
        "criteria_require_breaker_open": "on", "criteria_require_recovery": "on",
        "criteria_require_verification": "on",
    }  # fmt: skip
    response = client.post(f"/drills/{drill.pk}/edit/", body)

    assert response.status_code == 302
    drill.refresh_from_db()
    assert drill.criteria == {"max_failed_requests": 0}
    assert (drill.targets, drill.load_profile, drill.schedule) == ({}, {}, "")


def test_a_bad_criterion_is_named_on_its_field_and_nothing_is_created(client_as, world):
    client = client_as("operator")

    response = client.post("/drills/new/", _post(world, criteria_max_failed_requests="-1"))

    html = response.content.decode()
    assert response.status_code == 400
    assert 'data-field="criteria_max_failed_requests"' in html
    assert "criteria.max_failed_requests: must be an integer &gt;= 0" in html
    assert 'value="cut-east"' in html  # what was typed stays
    assert not Drill.objects.exists()
    assert not AuditLog.objects.filter(object_type="drills.drill").exists()


def test_bad_schedule_target_and_load_each_name_their_field(client_as, world):
    client = client_as("operator")
    cases = {
        "schedule": ({"schedule": "every day"}, "schedule: five fields expected"),
        "target_gateway_url": (
            {"target_gateway_url": "gw:8080"},
            "targets.gateway_url: an http:// or https:// base URL",
        ),
        "target_verify_prompts": (
            {"target_verify_prompts": "64, many"},
            "targets.verify_prompts: 1 to 16 prompt lengths",
        ),
        "load_concurrency": ({"load_concurrency": "0"}, "load_profile.concurrency: must be"),
        "fault_s": ({"fault_s": "0"}, "greater than or equal to 1"),
        "fault_s ": ({"fault_s": "nan"}, "Enter a number."),
    }
    for field, (overrides, message) in cases.items():
        response = client.post("/drills/new/", _post(world, **overrides))
        html = response.content.decode()
        assert response.status_code == 400, field
        assert f'data-field="{field.strip()}"' in html, field
        assert message in html, (field, html[html.find("field-error") - 200 :][:600])
    assert not Drill.objects.exists()


def test_a_taken_name_is_named_on_the_name_field(client_as, world):
    services.drill_create(actor=None, name="cut-east", deployment=world.deployment, kind="link_cut")

    response = client_as("operator").post("/drills/new/", _post(world))

    assert response.status_code == 400
    assert 'data-field="name"' in response.content.decode()
    assert Drill.objects.count() == 1


def test_viewer_sees_no_form_and_a_crafted_post_is_refused(client_as, world):
    drill = services.drill_create(
        actor=None, name="cut", deployment=world.deployment, kind="link_cut"
    )
    viewer = client_as("viewer")

    listing = viewer.get("/drills/").content.decode()
    detail = viewer.get(f"/drills/{drill.pk}/")

    assert detail.status_code == 200
    assert "New drill" not in listing
    assert "/edit/" not in listing + detail.content.decode()
    assert viewer.get("/drills/new/").status_code == 403
    assert viewer.get(f"/drills/{drill.pk}/edit/").status_code == 403
    assert viewer.post("/drills/new/", _post(world, name="other")).status_code == 403
    assert viewer.post(f"/drills/{drill.pk}/edit/", _post(world, name="cut")).status_code == 403
    drill.refresh_from_db()
    assert drill.fault_s == 60
    assert Drill.objects.count() == 1


def test_drill_page_shows_definition_and_reports(client_as, world):
    drill = services.drill_create(
        actor=None,
        name="cut",
        deployment=world.deployment,
        kind="link_cut",
        criteria={"max_time_to_recover_s": None},
    )
    report = services.drill_run(actor=None, drill=drill)

    html = client_as("operator").get(f"/drills/{drill.pk}/").content.decode()

    assert f'href="/drills/reports/{report.pk}/"' in html
    assert "not checked" in html  # max_time_to_recover_s: None
    assert f'hx-post="/api/drills/{drill.pk}/run/"' in html
    assert f'href="/drills/{drill.pk}/edit/"' in html


def test_a_drill_of_one_site_from_the_page_follows_that_sites_defaults(client_as, world):
    client = client_as("operator")

    response = client.post(
        "/drills/new/",
        _post(
            world, site="remote", criteria_require_fallback="", criteria_max_fallback_requests="3"
        ),
    )

    assert response.status_code == 302
    drill = Drill.objects.get(name="cut-east")
    assert drill.site == "remote"
    # require_fallback left at "default": one site's drill does not ask for it.
    assert drill.criteria == {
        "max_failed_requests": 2,
        "max_fallback_requests": 3,
        "max_time_to_detect_s": 5.0,
        "require_verification": False,
    }
    page = client.get(response["Location"]).content.decode()
    assert 'id="drill-site">remote' in page
    assert 'require_failover</th><td>True <span class="muted">(default)' in page


def test_a_site_that_is_not_a_prefill_site_is_named_on_its_field(client_as, world):
    response = client_as("operator").post("/drills/new/", _post(world, site="west"))

    html = response.content.decode()
    assert response.status_code == 400
    assert 'data-field="site"' in html
    assert "site: &#x27;west&#x27; is not a prefill site of deployment demo" in html
    assert not Drill.objects.exists()
