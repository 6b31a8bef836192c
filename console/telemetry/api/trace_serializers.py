"""Request traces over the API: the batch a gateway ships (validated and bounded here) and
the read side (a trace and its merged timeline)."""

from __future__ import annotations

import json
from typing import Any

from rest_framework import serializers

from console.telemetry.models import RequestTrace
from pdproto.http import REQUEST_ID_MAX_CHARS
from pdproto.trace import LEGS, MAX_ATTEMPTS, MAX_TRACES_PER_BATCH

#: The largest trace document accepted (a gateway's are well under 2 KiB).
MAX_TRACE_BYTES = 16 * 1024


class TraceLegSerializer(serializers.Serializer):
    leg = serializers.ChoiceField(choices=LEGS)
    start_ms = serializers.FloatField(min_value=0)
    end_ms = serializers.FloatField(min_value=0, allow_null=True, required=False)
    first_byte_ms = serializers.FloatField(min_value=0, allow_null=True, required=False)
    site = serializers.CharField(max_length=100, allow_null=True, required=False)
    instance = serializers.CharField(max_length=253, allow_null=True, required=False)
    source = serializers.CharField(max_length=64, required=False)


class TraceDocumentSerializer(serializers.Serializer):
    """One trace as :mod:`pdproto.trace` describes it; unknown fields are kept as sent."""

    version = serializers.IntegerField(min_value=1)
    request_id = serializers.CharField(max_length=REQUEST_ID_MAX_CHARS)
    started_at = serializers.DateTimeField()
    path = serializers.CharField(max_length=16, allow_blank=True)
    outcome = serializers.CharField(max_length=32, allow_blank=True)
    total_ms = serializers.FloatField(min_value=0, allow_null=True, required=False)
    legs = TraceLegSerializer(many=True, max_length=len(LEGS) * 2)
    attempts = serializers.ListField(
        child=serializers.DictField(), max_length=MAX_ATTEMPTS, required=False
    )

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict) and len(json.dumps(data, default=str)) > MAX_TRACE_BYTES:
            raise serializers.ValidationError(
                {"non_field_errors": [f"a trace may hold at most {MAX_TRACE_BYTES} bytes"]}
            )
        value = super().to_internal_value(data)
        # Keep the document's other fields (kv, failover, status ...) as the gateway sent them.
        return {**data, **value}


class TraceBatchSerializer(serializers.Serializer):
    """``{"traces": [...]}``: at most ``MAX_TRACES_PER_BATCH`` traces."""

    traces = TraceDocumentSerializer(many=True, max_length=MAX_TRACES_PER_BATCH)


class TraceBatchResultSerializer(serializers.Serializer):
    stored = serializers.IntegerField()


class RequestTraceSerializer(serializers.ModelSerializer):
    """A stored trace; ``node`` is the gateway's node."""

    class Meta:
        model = RequestTrace
        fields = [
            "id",
            "request_id",
            "node",
            "started_at",
            "path",
            "outcome",
            "total_ms",
            "skew_ms",
            "received_at",
            "document",
        ]
        read_only_fields = fields


class TimelineLegSerializer(serializers.Serializer):
    leg = serializers.CharField()
    start_ms = serializers.FloatField()
    end_ms = serializers.FloatField(allow_null=True)
    duration_ms = serializers.FloatField()
    at = serializers.DateTimeField(help_text="The leg's start on the console's clock.")
    site = serializers.CharField(allow_null=True, required=False)
    instance = serializers.CharField(allow_null=True, required=False)
    logs = serializers.DictField(
        allow_null=True,
        help_text="Where the leg's process logs: node, skew, the time on its clock, the "
        "agent's child names, ``log_pages`` (each child's console log page on this "
        "request's lines; operators) and the shell command that reads them.",
    )


class RequestTraceDetailSerializer(RequestTraceSerializer):
    """A stored trace with its legs on the console's clock and where to read their logs."""

    timeline = serializers.SerializerMethodField()

    class Meta(RequestTraceSerializer.Meta):
        fields = [*RequestTraceSerializer.Meta.fields, "timeline"]
        read_only_fields = fields

    def get_timeline(self, trace: RequestTrace) -> list[dict[str, Any]]:
        from console.telemetry.traces import trace_timeline

        out = []
        for row in trace_timeline(trace)["legs"]:
            where = row.get("where")
            logs = None
            if where is not None:
                logs = {k: v for k, v in where.items() if k != "node"}
                if "node_time" in logs:
                    logs["node_time"] = logs["node_time"].isoformat()
            out.append(
                {
                    "leg": row["leg"],
                    "start_ms": row.get("start_ms"),
                    "end_ms": row.get("end_ms"),
                    "duration_ms": row["duration_ms"],
                    "at": row["at"],
                    "site": row.get("site"),
                    "instance": row.get("instance"),
                    "logs": logs,
                }
            )
        return TimelineLegSerializer(out, many=True).data  # type: ignore[return-value]
