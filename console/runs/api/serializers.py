from rest_framework import serializers

from console.core.api.fields import created_by_field
from console.runs.models import StepRun, WorkflowRun


class StepRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = StepRun
        fields = [
            "index",
            "name",
            "state",
            "attempt",
            "evidence",
            "log_excerpt",
            "error",
            "worker",
            "heartbeat_at",
            "wake_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class WorkflowRunSerializer(serializers.ModelSerializer):
    steps = StepRunSerializer(many=True, read_only=True)
    created_by = created_by_field()

    class Meta:
        model = WorkflowRun
        fields = [
            "id",
            "kind",
            "target_type",
            "target_id",
            "state",
            "params",
            "result",
            "error",
            "cancel_requested",
            "created_by",
            "created_at",
            "started_at",
            "finished_at",
            "steps",
        ]
        read_only_fields = fields


class RunCreateSerializer(serializers.Serializer):
    """Start a workflow that needs no target (``selfcheck``); domain workflows (deploy,
    canary, drills) start from their own endpoints."""

    kind = serializers.CharField(max_length=64)
    params = serializers.DictField(required=False, default=dict)

    def validate_kind(self, value: str) -> str:
        from console.runs.selectors import standalone_workflows

        if value not in standalone_workflows():
            raise serializers.ValidationError(
                f"unknown workflow; one of: {', '.join(standalone_workflows())}"
            )
        return value


class RunRetrySerializer(serializers.Serializer):
    from_step = serializers.IntegerField(required=False, min_value=0)
