from __future__ import annotations

from typing import Any

from rest_framework import serializers

from console.core.api.fields import created_by_field
from console.drills.models import REPORT_FIGURES, Drill, DrillReport


class DrillSerializer(serializers.ModelSerializer):
    """A drill definition. On create, ``run_now`` (default true) also starts it."""

    run_now = serializers.BooleanField(write_only=True, required=False, default=True)
    last_report = serializers.SerializerMethodField()
    created_by = created_by_field()

    class Meta:
        model = Drill
        fields = [
            "id",
            "name",
            "deployment",
            "kind",
            "site",
            "fault_s",
            "baseline_s",
            "after_s",
            "recover_timeout_s",
            "load_profile",
            "criteria",
            "targets",
            "schedule",
            "periodic_task",
            "created_by",
            "created_at",
            "updated_at",
            "run_now",
            "last_report",
        ]
        read_only_fields = ["periodic_task", "created_by", "created_at", "updated_at"]

    def get_last_report(self, drill: Drill) -> dict[str, Any] | None:
        report = drill.reports.order_by("-created_at", "-id").first()
        if report is None:
            return None
        return {"id": report.pk, "state": report.state, "run": report.run_id}


class DrillReportSerializer(serializers.ModelSerializer):
    drill_name = serializers.CharField(source="drill.name", read_only=True)
    run_state = serializers.CharField(source="run.state", read_only=True, default=None)
    reason = serializers.CharField(
        source="failure_reason",
        read_only=True,
        help_text="Why a failed drill failed, in one line (empty unless failed).",
    )

    class Meta:
        model = DrillReport
        fields = [
            "id",
            "drill",
            "drill_name",
            "run",
            "run_state",
            "kind",
            "site",
            "state",
            "trigger",
            *REPORT_FIGURES,
            "criteria_results",
            "reason",
            "error",
            "created_at",
            "finished_at",
        ]
        read_only_fields = fields
