from rest_framework import serializers

from console.alerts.models import Alert, AlertRule, NotificationChannel
from console.core.api.fields import username_field


class AlertRuleSerializer(serializers.ModelSerializer):
    class Meta:
        model = AlertRule
        fields = [
            "id",
            "name",
            "layer",
            "level",
            "metric",
            "subject_type",
            "aggregate",
            "comparison",
            "threshold",
            "window_s",
            "summary",
            "enabled",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]


class AlertSerializer(serializers.ModelSerializer):
    class Meta:
        model = Alert
        fields = [
            "id",
            "rule",
            "rule_name",
            "level",
            "layer",
            "subject_type",
            "subject_id",
            "state",
            "value",
            "threshold",
            "message",
            "started_at",
            "last_seen_at",
            "resolved_at",
            "notifications",
            "acknowledged_at",
            "acknowledged_by",
            "acknowledged_note",
        ]
        read_only_fields = fields

    acknowledged_by = username_field(
        "acknowledged_by", "Username of who acknowledged it; null until someone does."
    )


class AcknowledgeSerializer(serializers.Serializer):
    note = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")


class NotificationChannelSerializer(serializers.ModelSerializer):
    class Meta:
        model = NotificationChannel
        fields = [
            "id",
            "name",
            "kind",
            "target",
            "min_level",
            "send_resolved",
            "enabled",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]
