from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from rest_framework import serializers

from console.core.choices import Role
from console.core.models import AuditLog
from console.core.roles import user_role

User = get_user_model()


class UserSerializer(serializers.ModelSerializer):
    # Blank for most accounts: the model's EmailField would be typed as a required e-mail.
    email = serializers.EmailField(read_only=True, allow_blank=True)
    role = serializers.SerializerMethodField()

    class Meta:
        model = User
        fields = ["id", "username", "email", "is_active", "role", "date_joined", "last_login"]
        read_only_fields = fields

    def get_role(self, obj: Any) -> str | None:
        role = user_role(obj)
        return role.value if role else None


class UserWriteSerializer(serializers.Serializer):
    """Input for creating or changing a user (admin only)."""

    username = serializers.RegexField(r"^[\w.@+-]{1,150}$", required=False)
    email = serializers.EmailField(required=False, allow_blank=True)
    role = serializers.ChoiceField(choices=Role.choices, required=False)
    password = serializers.CharField(required=False, write_only=True, min_length=8)
    is_active = serializers.BooleanField(required=False)

    def validate_password(self, value: str) -> str:
        validate_password(value)
        return value


class AuditLogSerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditLog
        fields = [
            "id",
            "created_at",
            "actor_label",
            "action",
            "verb",
            "object_type",
            "object_id",
            "object_repr",
            "before",
            "after",
            "request_id",
        ]
        read_only_fields = fields
