from rest_framework import serializers

from console.telemetry.models import MetricSample


class MetricSampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = MetricSample
        fields = ["id", "subject_type", "subject_id", "name", "value", "labels", "at"]
        read_only_fields = fields
