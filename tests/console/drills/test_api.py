"""Drills API: role matrix, 400s naming the field, a run started with its report, the beat
schedule, one drill at a time per deployment, reports readable by viewers."""

from __future__ import annotations

import json

import pytest
from django.test import override_settings
from django_celery_beat.models import PeriodicTask

from console.drills import services
from console.drills.choices import STEPS
from console.drills.models import Drill, DrillReport
from console.runs.models import WorkflowRun
from tests.conftest import role_client

pytestmark = pytest.mark.django_db


def _body(world, **extra):
    return {"name": "cut-1", "deployment": world.deployment.pk, "kind": "link_cut",
            "fault_s": 5, "baseline_s": 3, "after_s": 3, **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 403), ("operator", 201), ("admin", 201)]
)
def test_creating_and_running_a_drill_needs_operator(api_as, world, role, expected):
    response = role_client(api_as, role).post("/api/drills/", _body(world), format="json")

    assert response.status_code == expected
    assert DrillReport.objects.count() == (1 if expected == 201 else 0)


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 200), ("operator", 200), ("admin", 200)]
)
@pytest.mark.parametrize("path", ["/api/drills/", "/api/drills/{d}/", "/api/drill-reports/",
                                  "/api/drill-reports/{r}/"])  # fmt: skip
def test_drills_and_reports_are_readable_by_every_role(api_as, world, role, expected, path):
    drill = services.drill_create(
        actor=None, name="cut", deployment=world.deployment, kind="link_cut"
    )
    report = services.drill_run(actor=None, drill=drill)

    response = role_client(api_as, role).get(path.format(d=drill.pk, r=report.pk))

    assert response.status_code == expected


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 403), ("operator", 202), ("admin", 202)]
)
def test_running_again_needs_operator(api_as, world, role, expected):
    drill = services.drill_create(
        actor=None, name="cut", deployment=world.deployment, kind="link_cut"
    )

    response = role_client(api_as, role).post(f"/api/drills/{drill.pk}/run/")

    assert response.status_code == expected


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 403), ("operator", 204), ("admin", 204)]
)
def test_deleting_a_drill_needs_operator_and_removes_its_schedule(api_as, world, role, expected):
    drill = services.drill_create(
        actor=None, name="cut", deployment=world.deployment, kind="link_cut", schedule="0 3 * * 1"
    )

    response = role_client(api_as, role).delete(f"/api/drills/{drill.pk}/")

    assert response.status_code == expected
    assert PeriodicTask.objects.filter(name=f"drill:{drill.pk}").exists() == (expected != 204)


def test_post_starts_the_workflow_with_resolved_params_and_a_running_report(api_as, world):
    response = api_as("operator").post(
        "/api/drills/",
        _body(world, load_profile={"concurrency": 2}, criteria={"max_time_to_recover_s": 20}),
        format="json",
    )

    assert response.status_code == 201, response.json()
    body = response.json()
    report = DrillReport.objects.get(drill_id=body["id"])
    assert body["last_report"] == {"id": report.pk, "state": "running", "run": report.run_id}
    run = WorkflowRun.objects.get(pk=report.run_id)
    assert run.kind == "drill_link_cut"
    assert [s.name for s in run.steps.all()] == STEPS
    assert run.target_type == "drills.drill"
    assert run.params["faults"] == [
        {"agent": "10.0.0.5:7070", "node": "dec-1", "kind": "link_cut", "target": "remote"}
    ]
    # Where the decode agent cannot cut (the testbed: no route or proxy for the peer), the
    # prefill site's agent cuts the same link from its end.
    assert run.params["fault_alternatives"] == [
        [{"agent": "10.1.0.5:7070", "node": "pre-1", "kind": "link_cut", "target": "local"}]
    ]
    assert run.params["load"]["concurrency"] == 2
    assert run.params["load"]["max_tokens"] == 16
    assert run.params["criteria"]["max_time_to_recover_s"] == 20
    assert run.params["criteria"]["max_failed_requests"] == 0
    assert run.params["gateway_url"] == "https://dec-1:8080"  # the gateway serves TLS
    assert run.params["model"] == "qwen3next-tiny"


def test_remote_restart_targets_the_prefill_nodes_engine(world):
    drill = services.drill_create(
        actor=None, name="rr", deployment=world.deployment, kind="remote_restart",
        targets={"prefill_child": "prefill-a", "gateway_url": "https://gw:9443"},
    )  # fmt: skip

    report = services.drill_run(actor=None, drill=drill)

    params = report.run.params
    assert report.run.kind == "drill_remote_restart"
    assert params["faults"] == [
        {"agent": "10.1.0.5:7070", "node": "pre-1", "kind": "engine_kill", "target": "prefill-a"}
    ]
    assert params["gateway_url"] == "https://gw:9443"


def test_the_default_gateway_url_is_plain_http_only_on_an_insecure_testbed(api_as, world):
    with override_settings(PDBRIDGE_CONTROLLER_INSECURE=True):
        response = api_as("operator").post("/api/drills/", _body(world), format="json")

    assert response.status_code == 201, response.json()
    report = DrillReport.objects.get(drill_id=response.json()["id"])
    assert WorkflowRun.objects.get(pk=report.run_id).params["gateway_url"] == "http://dec-1:8080"


def test_deleting_a_drill_with_reports_is_409_and_keeps_them(api_as, world):
    created = api_as("operator").post("/api/drills/", _body(world), format="json").json()
    report = DrillReport.objects.get(drill_id=created["id"])

    response = api_as("operator").delete(f"/api/drills/{created['id']}/")

    assert response.status_code == 409
    assert response.json() == {
        "detail": "Drill cut-1 has 1 report(s); they are kept as evidence, so the drill cannot "
        "be deleted (clear its schedule to stop it running)."
    }
    assert Drill.objects.filter(pk=created["id"]).exists()
    assert api_as("viewer").get(f"/api/drill-reports/{report.pk}/").status_code == 200


def test_the_default_verification_sample_is_long_enough_to_go_remote(api_as, world):
    world.deployment.remote_prefill_threshold_tokens = 300
    world.deployment.save(update_fields=["remote_prefill_threshold_tokens"])

    response = api_as("operator").post("/api/drills/", _body(world), format="json")

    assert response.status_code == 201, response.json()
    report = DrillReport.objects.get(drill_id=response.json()["id"])
    assert WorkflowRun.objects.get(pk=report.run_id).params["verify_prompts"] == [600]


def test_the_default_sample_counts_the_models_characters_per_token(api_as, world):
    """Prompt lengths are characters: a BPE tokenizer's 3.2 characters a token (the vLLM
    testbed's model) need 3.2x the characters to reach the same token count."""
    world.deployment.remote_prefill_threshold_tokens = 100
    world.deployment.save(update_fields=["remote_prefill_threshold_tokens"])
    model = world.deployment.model
    model.engine_settings = {**(model.engine_settings or {}), "chars_per_token": 3.2}
    model.save(update_fields=["engine_settings"])

    response = api_as("operator").post("/api/drills/", _body(world), format="json")

    assert response.status_code == 201, response.json()
    report = DrillReport.objects.get(drill_id=response.json()["id"])
    assert WorkflowRun.objects.get(pk=report.run_id).params["verify_prompts"] == [640]


def test_create_without_running(api_as, world):
    response = api_as("operator").post("/api/drills/", _body(world, run_now=False), format="json")

    assert response.status_code == 201
    assert response.json()["last_report"] is None
    assert WorkflowRun.objects.count() == 0


def test_a_second_drill_on_the_same_deployment_is_409_while_one_runs(api_as, world):
    first = api_as("operator").post("/api/drills/", _body(world), format="json").json()
    second = services.drill_create(
        actor=None, name="rr", deployment=world.deployment, kind="remote_restart"
    )

    response = api_as("operator").post(f"/api/drills/{second.pk}/run/")

    assert response.status_code == 409
    assert "cut-1" in response.json()["detail"]
    # Once the first run ended without a report (canceled), its report is aborted and a new
    # drill may start.
    WorkflowRun.objects.filter(pk=first["last_report"]["run"]).update(state="canceled")
    assert api_as("operator").post(f"/api/drills/{second.pk}/run/").status_code == 202
    aborted = DrillReport.objects.get(pk=first["last_report"]["id"])
    assert aborted.state == "aborted"
    assert (
        aborted.error == f"run #{first['last_report']['run']} ended canceled before the report step"
    )


@pytest.mark.parametrize(
    ("extra", "field", "text"),
    [
        ({"kind": "meteor"}, "kind", ""),
        ({"fault_s": 0}, "fault_s", ""),
        ({"fault_s": "long"}, "fault_s", ""),
        ({"deployment": 999999}, "deployment", ""),
        ({"load_profile": {"concurrency": 0}}, "load_profile", "load_profile.concurrency"),
        ({"load_profile": {"speed": 1}}, "load_profile", "load_profile.speed"),
        ({"load_profile": {"mix": "1:2"}}, "load_profile", "load_profile.mix"),
        ({"load_profile": {"rate": -2}}, "load_profile", "load_profile.rate"),
        ({"load_profile": [1]}, "load_profile", ""),
        ({"criteria": {"max_failed_requests": -1}}, "criteria", "criteria.max_failed_requests"),
        ({"criteria": {"require_fallback": "yes"}}, "criteria", "criteria.require_fallback"),
        ({"criteria": {"luck": 1}}, "criteria", "criteria.luck"),
        ({"targets": {"gateway_url": "gw:80"}}, "targets", "targets.gateway_url"),
        ({"targets": {"verify_prompts": [1]}}, "targets", "targets.verify_prompts"),
        ({"schedule": "every day"}, "schedule", "schedule"),
        ({"schedule": "0 3 * *"}, "schedule", "schedule"),
        ({"name": "Not A Slug!"}, "name", ""),
    ],
)
def test_bad_input_is_400_naming_the_field(api_as, world, extra, field, text):
    response = api_as("operator").post("/api/drills/", _body(world, **extra), format="json")

    assert response.status_code == 400, response.json()
    body = response.json()
    assert field in body, body
    assert text in json.dumps(body[field])
    assert Drill.objects.count() == 0


def test_deployment_without_prefill_pool_is_400(api_as, world):
    world.prefill_pool.delete()

    response = api_as("operator").post("/api/drills/", _body(world), format="json")

    assert response.status_code == 400
    assert "prefill" in json.dumps(response.json()["deployment"])


def test_schedule_creates_updates_and_removes_the_periodic_task(api_as, world):
    created = api_as("operator").post(
        "/api/drills/", _body(world, run_now=False, schedule="30  4 * * 1-5"), format="json"
    )
    drill_id = created.json()["id"]

    task = PeriodicTask.objects.get(name=f"drill:{drill_id}")
    assert task.task == "orchestrator.drills.run_scheduled"
    assert json.loads(task.args) == [drill_id]
    assert (task.crontab.minute, task.crontab.hour, task.crontab.day_of_week) == ("30", "4", "1-5")
    assert created.json()["schedule"] == "30 4 * * 1-5"

    api_as("operator").patch(f"/api/drills/{drill_id}/", {"schedule": "0 1 * * *"}, format="json")
    task.refresh_from_db()
    assert (task.crontab.minute, task.crontab.hour) == ("0", "1")

    api_as("operator").patch(f"/api/drills/{drill_id}/", {"schedule": ""}, format="json")
    assert not PeriodicTask.objects.filter(name=f"drill:{drill_id}").exists()


def test_reports_filter_by_state_and_drill(api_as, world):
    drill = services.drill_create(
        actor=None, name="cut", deployment=world.deployment, kind="link_cut"
    )
    report = services.drill_run(actor=None, drill=drill)

    running = api_as("viewer").get(f"/api/drill-reports/?state=running&drill={drill.pk}").json()
    passed = api_as("viewer").get("/api/drill-reports/?state=passed").json()

    assert [r["id"] for r in running["results"]] == [report.pk]
    assert passed["results"] == []


def test_run_audited(api_as, world):
    body = api_as("operator").post("/api/drills/", _body(world), format="json").json()

    log = api_as("viewer").get(f"/api/audit-log/?object_type=drills.drill&object_id={body['id']}")

    assert sorted(e["action"] for e in log.json()["results"]) == ["action", "create"]


def _second_site(world):
    """A second remote prefill site (``east``) with its own node and pool on the deployment."""
    from console.deployments.services import pool_create
    from tests.console.factories import NodeFactory, SiteFactory

    east = SiteFactory(name="east", role="prefill")
    node = NodeFactory(site=east, hostname="pre-east", agent_address="10.2.0.5:7070")
    pool_create(actor=None, deployment=world.deployment, role="prefill", site=east, nodes=[node])
    return east


def test_a_drill_of_one_site_faults_that_site_only(api_as, world):
    _second_site(world)

    response = api_as("operator").post("/api/drills/", _body(world, site="east"), format="json")

    assert response.status_code == 201, response.json()
    assert response.json()["site"] == "east"
    report = DrillReport.objects.get(drill_id=response.json()["id"])
    params = report.run.params
    assert report.site == "east"
    assert (params["site"], params["prefill_sites"]) == ("east", ["east", "remote"])
    assert params["faults"] == [
        {"agent": "10.0.0.5:7070", "node": "dec-1", "kind": "link_cut", "target": "east"}
    ]
    assert params["fault_alternatives"] == [
        [{"agent": "10.2.0.5:7070", "node": "pre-east", "kind": "link_cut", "target": "local"}]
    ]
    # One site down, the others serve: failover is expected, local fallback is not.
    assert (params["criteria"]["require_failover"], params["criteria"]["require_fallback"]) == (
        True,
        False,
    )
    served = api_as("viewer").get(f"/api/drill-reports/{report.pk}/").json()
    assert (served["site"], served["sites"]) == ("east", {})


def test_a_remote_restart_of_one_site_restarts_that_sites_engines_only(world):
    _second_site(world)
    drill = services.drill_create(
        actor=None, name="rr-east", deployment=world.deployment, kind="remote_restart",
        site="east", targets={"prefill_child": "prefill-a"},
    )  # fmt: skip

    params = services.drill_run(actor=None, drill=drill).run.params

    assert params["faults"] == [
        {"agent": "10.2.0.5:7070", "node": "pre-east", "kind": "engine_kill", "target": "prefill-a"}
    ]


@pytest.mark.parametrize("site", ["west", "local", 7])
def test_a_site_that_is_not_a_prefill_site_is_400_naming_the_field(api_as, world, site):
    response = api_as("operator").post("/api/drills/", _body(world, site=site), format="json")

    assert response.status_code == 400, response.json()
    [message] = response.json()["site"]
    assert message == (
        f"site: '{site}' is not a prefill site of deployment demo (one of: remote; empty: "
        "every prefill site)"
    )
    assert Drill.objects.count() == 0


def test_a_site_pool_removed_after_the_drill_was_written_is_400_at_run(api_as, world):
    east = _second_site(world)
    drill = services.drill_create(
        actor=None, name="cut-east", deployment=world.deployment, kind="link_cut", site="east"
    )
    world.deployment.pools.get(site=east).delete()

    response = api_as("operator").post(f"/api/drills/{drill.pk}/run/")

    assert response.status_code == 400
    assert "'east' is not a prefill site" in response.json()["site"][0]


def test_drills_and_reports_filter_by_site(api_as, world):
    _second_site(world)
    for name, site in (("cut-all", ""), ("cut-east", "east")):
        drill = services.drill_create(
            actor=None, name=name, deployment=world.deployment, kind="link_cut", site=site
        )
        report = services.drill_run(actor=None, drill=drill)
        services.drill_report_abort(run_id=report.run_id, error="test: one at a time")
        WorkflowRun.objects.filter(pk=report.run_id).update(state="failed")

    drills = api_as("viewer").get("/api/drills/?site=east").json()["results"]
    reports = api_as("viewer").get("/api/drill-reports/?site=east").json()["results"]

    assert [d["name"] for d in drills] == ["cut-east"]
    assert [(r["drill_name"], r["site"]) for r in reports] == [("cut-east", "east")]
