from __future__ import annotations

from typing import Any

from django.contrib.auth import authenticate, get_user_model
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


class TokenObtainSerializer(serializers.Serializer):
    """``POST /api/auth/token/``: a username and password for a new API token (the fields and
    the 400 for bad credentials of DRF's ``obtain_auth_token``, which this replaces)."""

    username = serializers.CharField(write_only=True)
    password = serializers.CharField(
        write_only=True, trim_whitespace=False, style={"input_type": "password"}
    )
    name = serializers.CharField(
        write_only=True,
        required=False,
        default="",
        allow_blank=True,
        max_length=100,
        help_text="What the token is for (a script, a machine); shown with its prefix.",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        user = authenticate(
            request=self.context.get("request"),
            username=attrs["username"],
            password=attrs["password"],
        )
        if user is None:  # also an inactive user (ModelBackend refuses them)
            raise serializers.ValidationError(
                "Unable to log in with provided credentials.", code="authorization"
            )
        attrs["user"] = user
        return attrs


class TokenIssuedSerializer(serializers.Serializer):
    """A newly issued API token: the only time it can be read (only its hash is stored)."""

    token = serializers.CharField(help_text="Send as `Authorization: Token <token>`.")
    token_prefix = serializers.CharField(help_text="Its first characters, to tell tokens apart.")
    name = serializers.CharField()
