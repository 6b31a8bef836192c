from rest_framework import serializers

from console.catalog.models import ModelSpec


class ModelSpecSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelSpec
        fields = [
            "id",
            "name",
            "family",
            "architecture",
            "architecture_hash",
            "parameter_count",
            "weights_uri",
            "weights_sha256",
            "engine_settings",
            "notes",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["architecture_hash", "created_at", "updated_at"]


class KvSizeRowSerializer(serializers.Serializer):
    tokens = serializers.IntegerField()
    kv_bytes = serializers.IntegerField()
    fixed_bytes = serializers.IntegerField()
    per_token_bytes = serializers.IntegerField()
    windowed_bytes = serializers.IntegerField()
    dense_equivalent_bytes = serializers.IntegerField()
    reduction = serializers.FloatField(allow_null=True)
    baseline_bytes = serializers.IntegerField(required=False)
    reduction_vs_baseline = serializers.FloatField(required=False)


class KvSizeSerializer(serializers.Serializer):
    model = serializers.IntegerField()
    name = serializers.CharField()
    architecture_hash = serializers.CharField()
    dense_equivalent = serializers.DictField()
    baseline = serializers.CharField(allow_null=True)
    results = KvSizeRowSerializer(many=True)
