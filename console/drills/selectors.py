"""Reads for drills and reports."""

from __future__ import annotations

from django.db.models import QuerySet

from console.drills.models import Drill, DrillReport


def drill_list() -> QuerySet[Drill]:
    return Drill.objects.select_related("deployment", "periodic_task", "created_by")


def report_list() -> QuerySet[DrillReport]:
    return DrillReport.objects.select_related("drill", "run")
