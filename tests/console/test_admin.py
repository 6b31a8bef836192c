"""The Django admin lists every console model, and its edits go through the services."""

from __future__ import annotations

import pytest

from console.core.models import AuditLog
from console.inventory.models import Site

pytestmark = pytest.mark.django_db

MODELS = [
    "inventory/site",
    "inventory/node",
    "inventory/link",
    "inventory/nodecredential",
    "catalog/modelspec",
    "deployments/deployment",
    "deployments/pool",
    "deployments/configsnapshot",
    "rollouts/rolloutplan",
]


@pytest.fixture
def admin_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("root", "", "pw-for-tests-1")
    client.force_login(user)
    return client


@pytest.mark.parametrize("model", MODELS)
def test_changelist_and_detail_pages_render(admin_client, world, model):
    assert admin_client.get(f"/admin/{model}/").status_code == 200


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
