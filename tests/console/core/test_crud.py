"""``audited_update``: a write that changes nothing is not a write -- no save, no audit entry,
and (for links) no new config versions of the deployments that use it; a real change is all
three. ``updated_at`` moving on save once made every update look like a change."""

from __future__ import annotations

import pytest

from console.core.models import AuditLog
from console.inventory.services import link_update

pytestmark = pytest.mark.django_db


def test_a_no_op_update_writes_and_audits_nothing_and_a_change_does(world):
    versions = world.deployment.snapshots.count()
    stamp = world.link.updated_at
    audited = AuditLog.objects.count()

    link_update(actor=None, link=world.link, provisioned_mbit_s=world.link.provisioned_mbit_s)

    world.link.refresh_from_db()
    assert world.link.updated_at == stamp
    assert AuditLog.objects.count() == audited
    assert world.deployment.snapshots.count() == versions

    link_update(actor=None, link=world.link, provisioned_mbit_s=world.link.provisioned_mbit_s + 1)

    world.link.refresh_from_db()
    assert world.link.updated_at > stamp
    assert AuditLog.objects.filter(action="update", object_type="inventory.link").count() == 1
    assert world.deployment.snapshots.count() == versions + 1
