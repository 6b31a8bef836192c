"""The alert rule admin: shipped rules cannot be deleted there either."""

from __future__ import annotations

import pytest

from console.alerts.models import AlertRule
from console.alerts.services import alert_rule_create

pytestmark = pytest.mark.django_db


def test_the_admin_keeps_shipped_rules_and_deletes_added_ones(admin_client):
    shipped = AlertRule.objects.get(name="link-rtt-high")
    added = alert_rule_create(
        actor=None,
        name="kv-queue-high",
        layer="service",
        level="info",
        metric="kv_link_queue_bytes",
        comparison="gt",
        threshold=1e9,
    )

    def bulk(*pks: int) -> int:
        body = {"action": "delete_selected", "_selected_action": list(pks), "post": "yes"}
        return admin_client.post("/admin/alerts/alertrule/", body).status_code

    page = admin_client.get(f"/admin/alerts/alertrule/{shipped.pk}/delete/")
    both = bulk(shipped.pk, added.pk)
    kept = AlertRule.objects.filter(pk__in=[shipped.pk, added.pk]).count()
    only_added = bulk(added.pk)

    assert (page.status_code, both, kept) == (403, 403, 2)
    assert only_added == 302
    assert AlertRule.objects.filter(pk=shipped.pk).exists()
    assert not AlertRule.objects.filter(pk=added.pk).exists()
