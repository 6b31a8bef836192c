from __future__ import annotations

import django_filters

from console.drills.models import Drill, DrillReport


class DrillFilterSet(django_filters.FilterSet):
    class Meta:
        model = Drill
        fields = ["deployment", "kind", "name", "site"]


class DrillReportFilterSet(django_filters.FilterSet):
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")

    class Meta:
        model = DrillReport
        fields = ["drill", "kind", "state", "trigger", "site"]
