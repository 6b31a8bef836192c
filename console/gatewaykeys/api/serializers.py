from rest_framework import serializers

from console.core.api.fields import created_by_field, username_field
from console.deployments.models import Deployment
from console.gatewaykeys.models import NAME_RE, GatewayKey


class GatewayKeySerializer(serializers.ModelSerializer):
    """A key as listed: never the key or its hash."""

    created_by = created_by_field()
    revoked_by = username_field("revoked_by", "Username of who revoked it; null while active.")
    active = serializers.BooleanField(read_only=True)

    class Meta:
        model = GatewayKey
        fields = [
            "id",
            "deployment",
            "name",
            "key_prefix",
            "active",
            "created_by",
            "created_at",
            "revoked_by",
            "revoked_at",
        ]
        read_only_fields = fields


class GatewayKeyCreateSerializer(serializers.Serializer):
    """Input of ``POST /api/gateway-keys/``."""

    deployment = serializers.PrimaryKeyRelatedField(queryset=Deployment.objects.all())
    name = serializers.RegexField(
        NAME_RE,
        max_length=64,
        error_messages={"invalid": "1-64 letters, digits, '_', '.', '-'."},
    )


class GatewayKeyCreatedSerializer(GatewayKeySerializer):
    """The answer to a create: the key itself, this one time."""

    key = serializers.CharField(read_only=True)

    class Meta(GatewayKeySerializer.Meta):
        fields = [*GatewayKeySerializer.Meta.fields, "key"]
        read_only_fields = fields


class GatewayAccessSerializer(serializers.Serializer):
    """Input of ``PUT /api/deployments/{id}/gateway-access/``."""

    require_client_keys = serializers.BooleanField()


class AccessKeySerializer(serializers.Serializer):
    name = serializers.CharField()
    sha256 = serializers.CharField()
    prefix = serializers.CharField()


class AccessDocumentSerializer(serializers.Serializer):
    """The document a deployment's gateway polls."""

    deployment = serializers.IntegerField()
    require_client_keys = serializers.BooleanField()
    keys = AccessKeySerializer(many=True)
