from rest_framework import serializers

from console.rollouts.models import RolloutPlan


class RolloutPlanSerializer(serializers.ModelSerializer):
    class Meta:
        model = RolloutPlan
        fields = [
            "id",
            "name",
            "deployment",
            "steps",
            "gate_ttft_p50_ratio",
            "gate_ttft_p99_ratio",
            "gate_success_rate_min",
            "gate_link_utilization_max",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]
