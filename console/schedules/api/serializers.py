from __future__ import annotations

from typing import Any

from rest_framework import serializers

from console.schedules.models import (
    RebalanceProposal,
    SitePriceTable,
    TidalApplication,
    TidalSchedule,
)
from console.schedules.selectors import DEFAULT_DAYS, MAX_DAYS
from console.schedules.services import MAX_CAPACITY

WHAT_IF_FIELDS = (
    "scenario",
    "capacity",
    "demand_rps",
    "ttft_limit_ms",
    "rtt_ms",
    "gpus_per_instance",
    "remote_prices",
    "local_prices",
)


class SitePriceTableSerializer(serializers.ModelSerializer):
    class Meta:
        model = SitePriceTable
        fields = [
            "id",
            "site",
            "gpu_hour_prices",
            "energy_prices_kwh",
            "kw_per_gpu",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]


class TidalScheduleSerializer(serializers.ModelSerializer):
    class Meta:
        model = TidalSchedule
        fields = [
            "id",
            "deployment",
            "enabled",
            "timezone",
            "ttft_limit_ms",
            "scenario",
            "remote_site",
            "local_site",
            "gpus_per_instance",
            "capacity",
            "demand_rps",
            "rtt_ms",
            "rebalance_auto_apply",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]


class WhatIfSerializer(serializers.Serializer):
    """Overrides for a what-if: any of the schedule's inputs, plus hourly price lists."""

    scenario = serializers.JSONField(required=False)
    capacity = serializers.JSONField(required=False)
    demand_rps = serializers.JSONField(required=False)
    ttft_limit_ms = serializers.IntegerField(required=False, min_value=1, max_value=3_600_000)
    rtt_ms = serializers.FloatField(required=False, min_value=0, max_value=10_000)
    gpus_per_instance = serializers.IntegerField(required=False, min_value=1, max_value=64)
    remote_prices = serializers.JSONField(required=False)
    local_prices = serializers.JSONField(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(self.initial_data) - set(WHAT_IF_FIELDS))
        if unknown:
            raise serializers.ValidationError({unknown[0]: ["Not a what-if field."]})
        return attrs


class RecordedCostQuerySerializer(serializers.Serializer):
    """Query of ``GET /api/tidal-schedules/{id}/recorded-cost/`` (docs/planner.md)."""

    days = serializers.IntegerField(
        required=False,
        default=DEFAULT_DAYS,
        min_value=1,
        max_value=MAX_DAYS,
        help_text="Whole days of recorded traffic before the current hour.",
    )
    static_remote_instances = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=MAX_CAPACITY,
        help_text="Remote instances without the schedule (default: the remote prefill pool).",
    )


class TidalApplicationSerializer(serializers.ModelSerializer):
    class Meta:
        model = TidalApplication
        fields = [
            "id",
            "schedule",
            "hour_start",
            "hour",
            "outcome",
            "plan",
            "before",
            "after",
            "config_version",
            "scale",
            "error",
            "checks",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields


class RebalanceProposalSerializer(serializers.ModelSerializer):
    class Meta:
        model = RebalanceProposal
        fields = [
            "id",
            "deployment",
            "state",
            "measured",
            "current_split",
            "target_split",
            "moves",
            "reason",
            "run",
            "decided_by_label",
            "created_at",
            "decided_at",
        ]
        read_only_fields = fields
