"""Draining pool nodes (``pool_set_drained``): the config document marks them, every change is
one new version with an audit entry, a repeat changes nothing, and a restore keeps them."""

import pytest
from django.core.exceptions import ValidationError

from console.core.models import AuditLog
from console.deployments.config import build_config
from console.deployments.models import Deployment
from console.deployments.services import deployment_restore, pool_create, pool_set_drained
from tests.console.factories import NodeFactory, SiteFactory, make_deployment

pytestmark = pytest.mark.django_db


def _world():
    remote = SiteFactory(name="remote", role="prefill")
    nodes = [NodeFactory(site=remote, hostname=h) for h in ("pre-1", "pre-2")]
    deployment = make_deployment(name="drain")
    pool = pool_create(actor=None, deployment=deployment, role="prefill", site=remote, nodes=nodes)
    deployment.refresh_from_db()
    return deployment, pool, nodes


def _docs(deployment):
    return build_config(deployment)["pools"]["prefill"][0]["nodes"]


def test_a_drained_node_is_marked_in_a_new_version_and_rejoins_in_another():
    deployment, pool, (_, pre2) = _world()
    start = deployment.version

    drained = pool_set_drained(actor=None, pool=pool, drain=[pre2], reason="tidal 12:00")
    again = pool_set_drained(actor=None, pool=pool, drain=[pre2])

    deployment.refresh_from_db()
    assert (drained, again, deployment.version) == (start + 1, start + 1, start + 1)
    assert _docs(deployment)[1] == {
        "hostname": "pre-2",
        "agent_address": pre2.agent_address,
        "drained": True,
    }
    assert "drained" not in _docs(deployment)[0]
    snapshot = deployment.snapshots.get(version=start + 1)
    assert snapshot.reason == "tidal 12:00"
    assert build_config(deployment)["kv_transfer"]["allowed_peers"] == ["pre-1", "pre-2"]
    audit = AuditLog.objects.filter(verb="drain").get()
    assert (audit.before["drained"], audit.after["drained"]) == ([], ["pre-2"])

    rejoined = pool_set_drained(actor=None, pool=pool, rejoin=[pre2])
    deployment.refresh_from_db()
    assert rejoined == start + 2
    assert all("drained" not in n for n in _docs(deployment))


def test_a_node_outside_the_pool_is_refused_naming_drain():
    _, pool, _ = _world()
    stranger = NodeFactory(site=pool.site, hostname="pre-9")

    with pytest.raises(ValidationError) as error:
        pool_set_drained(actor=None, pool=pool, drain=[stranger])

    assert error.value.message_dict == {"drain": ["Not in this pool: pre-9."]}


def test_a_restore_keeps_the_nodes_drained_now():
    deployment, pool, (_, pre2) = _world()
    old = deployment.version
    pool_set_drained(actor=None, pool=pool, drain=[pre2])
    deployment.refresh_from_db()

    restored = deployment_restore(actor=None, deployment=deployment, version=old)

    assert _docs(restored)[1].get("drained") is True


def test_operators_drain_and_rejoin_through_the_api_and_bad_input_names_the_field(api_as):
    deployment, pool, (_, pre2) = _world()
    url = f"/api/pools/{pool.pk}/drain/"
    stranger = NodeFactory(site=pool.site, hostname="elsewhere")

    assert api_as("viewer").post(url, {"drain": [pre2.pk]}, format="json").status_code == 403
    operator = api_as("operator")
    empty = operator.post(url, {}, format="json")
    assert empty.status_code == 400
    assert "drain" in empty.json()
    unknown = operator.post(url, {"drain": [999999]}, format="json")
    assert unknown.status_code == 400
    assert "drain" in unknown.json()
    outside = operator.post(url, {"drain": [stranger.pk]}, format="json")
    assert outside.status_code == 400
    assert "elsewhere" in str(outside.json()["drain"])

    drained = operator.post(url, {"drain": [pre2.pk], "reason": "by hand"}, format="json")
    assert drained.status_code == 200, drained.json()
    assert drained.json()["drained_nodes"] == [pre2.pk]
    assert _docs(Deployment.objects.get(pk=deployment.pk))[1]["drained"] is True
    back = operator.post(url, {"rejoin": [pre2.pk]}, format="json")
    assert back.status_code == 200
    assert back.json()["drained_nodes"] == []
    assert AuditLog.objects.filter(verb="drain").count() == 2
