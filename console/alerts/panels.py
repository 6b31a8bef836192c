"""The alerts panel of the console's overview: firing alerts, loudest first. Registered from
``AlertsConfig.ready()`` through ``console.core.panels``; two queries per overview."""

from __future__ import annotations

from typing import Any

from django.db.models import Case, IntegerField, Value, When
from django.http import HttpRequest

from console.alerts.choices import LEVEL_RANK, AlertState
from console.alerts.models import Alert

SHOWN = 20


def firing_alerts_context(request: HttpRequest) -> dict[str, Any]:
    """The firing alerts (at most ``SHOWN``, critical first, oldest first within a level) and
    how many fire in all."""
    firing = Alert.objects.filter(state=AlertState.FIRING)
    rank = Case(
        *(When(level=level, then=Value(r)) for level, r in LEVEL_RANK.items()),
        default=Value(-1),
        output_field=IntegerField(),
    )
    alerts = list(firing.annotate(rank=rank).order_by("-rank", "started_at", "id")[:SHOWN])
    return {"alerts": alerts, "firing_count": firing.count()}
