"""The Django admin lists every console model, and its edits go through the services."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth import get_user_model

from console.alerts.services import alerts_evaluate
from console.core.models import AuditLog
from console.core.services_tokens import api_token_issue
from console.inventory.liveness import liveness_check
from console.inventory.models import Site
from console.inventory.services import node_token_issue

NOW = datetime(2026, 11, 30, 5, tzinfo=UTC)

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("root", "", "pw-for-tests-1")
    client.force_login(user)
    return client


def _console_models() -> list[Any]:
    return [m for m in apps.get_models() if m.__module__.startswith("console.")]


def _inlined() -> set[Any]:
    return {
        inline.model
        for model_admin in admin.site._registry.values()
        for inline in model_admin.inlines
    }


def test_every_console_model_is_in_the_admin():
    missing = [
        m._meta.label_lower
        for m in _console_models()
        if not admin.site.is_registered(m) and m not in _inlined()
    ]

    assert len(_console_models()) > 20
    assert missing == []


@pytest.fixture
def every_row(world):
    """``world`` plus a row of the models it lacks (runs, drills, schedules, alerts, planner)."""
    from console.alerts.services import channel_create
    from console.drills import services as drills
    from console.gatewaykeys.services import gateway_access_update, gateway_key_create
    from console.planner.presets import preset_scenario
    from console.planner.services import scenario_create
    from console.rollouts.services import rollout_plan_create
    from console.runs.services import run_create
    from console.schedules.models import RebalanceProposal
    from console.schedules.services import (
        price_table_create,
        tidal_apply_hour,
        tidal_schedule_create,
    )
    from console.telemetry.services import sample_record, trace_record_batch

    node_token_issue(actor=None, node=world.decode_node)
    api_token_issue(
        actor=None, user=get_user_model().objects.create_user("api-user"), name="automation"
    )
    rollout_plan_create(actor=None, name="plan")
    run_create(actor=None, kind="selfcheck", steps=["database"], start=False)
    drills.drill_run(
        actor=None,
        drill=drills.drill_create(
            actor=None, name="cut", deployment=world.deployment, kind="link_cut"
        ),
    )
    scenario = preset_scenario("prfaas-case-study")
    scenario_create(actor=None, name="case", body=scenario)
    price_table_create(actor=None, site=world.remote, gpu_hour_prices=[2.0] * 24)
    schedule = tidal_schedule_create(
        actor=None,
        deployment=world.deployment,
        enabled=True,
        scenario=scenario,
        remote_site=world.remote,
        local_site=world.local,
        capacity=[1] * 24,
    )
    assert tidal_apply_hour(schedule_id=schedule.pk, now=NOW) is not None
    RebalanceProposal.objects.create(deployment=world.deployment, reason="admin test", moves=[])
    sample_record(subject=world.link, name="link_rtt_ms", value=1000.0, at=NOW)
    alerts_evaluate(now=NOW.replace(minute=1), notify=False)
    liveness_check(now=NOW)  # the liveness watch row
    channel_create(actor=None, name="hook", kind="webhook", target="https://hooks.example.com/x")
    gateway_key_create(actor=None, deployment=world.deployment, name="team-a")
    gateway_access_update(actor=None, deployment=world.deployment, require_client_keys=True)
    trace_record_batch(
        node=world.decode_node,
        traces=[{"request_id": "req-1", "started_at": NOW, "path": "remote", "total_ms": 80.0}],
    )
    return world


def test_every_registered_console_model_lists_and_shows_a_row(admin_client, every_row):
    failures = []
    for model in _console_models():
        if not admin.site.is_registered(model):
            continue  # an inline, shown on its parent's page
        label = f"{model._meta.app_label}/{model._meta.model_name}"
        row = model.objects.first()
        if row is None:
            failures.append((label, "no row to show"))
            continue
        for url in (f"/admin/{label}/", f"/admin/{label}/{row.pk}/change/"):
            status = admin_client.get(url).status_code
            if status != 200:
                failures.append((url, status))

    assert failures == []


def test_deployment_detail_is_read_only(admin_client, world):
    response = admin_client.get(f"/admin/deployments/deployment/{world.deployment.pk}/change/")

    assert response.status_code == 200
    assert b'name="_save"' not in response.content


def test_admin_site_edit_goes_through_the_service(admin_client, world):
    response = admin_client.post(
        f"/admin/inventory/site/{world.local.pk}/change/",
        {
            "name": "local",
            "region": "eu-central",
            "role": "decode",
            "gpu_hour_price": "3.5",
            "notes": "",
        },
    )

    assert response.status_code == 302
    assert Site.objects.get(pk=world.local.pk).region == "eu-central"
    entry = AuditLog.objects.get(object_type="inventory.site", action="update")
    assert entry.actor_label == "root"
    assert entry.after["region"] == "eu-central"


def test_admin_model_create_computes_hash(admin_client):
    response = admin_client.post(
        "/admin/catalog/modelspec/add/",
        {
            "name": "via-admin",
            "family": "",
            "architecture": '{"layers": [{"kind": "full", "kv_heads": 1, "head_dim": 8}]}',
            "parameter_count": "10",
            "weights_uri": "",
            "weights_sha256": "",
            "engine_settings": "{}",
            "notes": "",
        },
    )

    assert response.status_code == 302
    from console.catalog.models import ModelSpec

    assert len(ModelSpec.objects.get(name="via-admin").architecture_hash) == 64


def test_admin_shows_architecture_and_step_errors_on_the_form(admin_client):
    model = admin_client.post(
        "/admin/catalog/modelspec/add/",
        {
            "name": "bad",
            "architecture": '{"layers": []}',
            "parameter_count": "10",
            "engine_settings": "{}",
        },
    )
    plan = admin_client.post(
        "/admin/rollouts/rolloutplan/add/",
        {
            "name": "bad",
            "steps": '[{"share_percent": 50}]',
            "gate_ttft_p50_ratio": "1.2",
            "gate_ttft_p99_ratio": "1.5",
            "gate_success_rate_min": "0.99",
            "gate_link_utilization_max": "0.7",
        },
    )

    assert model.status_code == 200
    assert b"layers: must be a non-empty list" in model.content
    assert plan.status_code == 200
    assert b"the last step must be 100" in plan.content


def test_a_delete_the_service_refuses_is_shown_not_a_500(admin_client, world):
    """The admin deletes through the service: a node serving an active deployment is refused
    with the service's reason on the page, for the delete view and the bulk action alike."""
    from console.deployments.models import Deployment
    from console.inventory.models import Node

    Deployment.objects.filter(pk=world.deployment.pk).update(state="active")
    node = world.prefill_node
    url = f"/admin/inventory/node/{node.pk}/delete/"

    response = admin_client.post(url, {"post": "yes"}, follow=True)

    assert response.status_code == 200
    assert "serves deployment demo" in response.content.decode()
    bulk = admin_client.post(
        "/admin/inventory/node/",
        {"action": "delete_selected", "_selected_action": [node.pk], "post": "yes"},
        follow=True,
    )
    assert bulk.status_code == 200
    assert "serves deployment demo" in bulk.content.decode()
    assert Node.objects.filter(pk=node.pk).exists()
