from __future__ import annotations

from typing import Any

import django_filters
from django.contrib.auth import get_user_model
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import api_view, permission_classes
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from console.core import services_tokens, services_users
from console.core.api.base import ConsoleReadOnlyViewSet, ConsoleViewSetMixin
from console.core.api.serializers import (
    AuditLogSerializer,
    TokenIssuedSerializer,
    TokenObtainSerializer,
    UserSerializer,
    UserWriteSerializer,
)
from console.core.choices import Role
from console.core.models import AuditLog

User = get_user_model()


class AuditLogFilter(django_filters.FilterSet):
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = AuditLog
        fields = ["action", "verb", "object_type", "object_id", "actor_label", "request_id"]


class AuditLogViewSet(ConsoleReadOnlyViewSet):
    """The audit log: every write, newest first. Read-only for everyone with a role."""

    queryset = AuditLog.objects.all()
    serializer_class = AuditLogSerializer
    filterset_class = AuditLogFilter
    ordering_fields = ["id", "created_at"]
    ordering = ["-created_at", "-id"]


class UserViewSet(
    ConsoleViewSetMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet,
):
    """Users and their roles. Admin only, reads included (the list names every account)."""

    queryset = User.objects.all().prefetch_related("groups")
    serializer_class = UserSerializer
    read_role = Role.ADMIN
    write_role = Role.ADMIN
    filterset_fields = ["username", "is_active"]
    search_fields = ["username", "email"]

    @extend_schema(request=UserWriteSerializer, responses={201: UserSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = UserWriteSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        missing = {
            f: ["This field is required."]
            for f in ("username", "password", "role")
            if f not in data.validated_data
        }
        if missing:
            return Response(missing, status=status.HTTP_400_BAD_REQUEST)
        user = services_users.user_create(actor=request.user, **data.validated_data)
        return Response(UserSerializer(user).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=UserWriteSerializer, responses=UserSerializer)
    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        user = self.get_object()
        data = UserWriteSerializer(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        user = services_users.user_update(actor=request.user, user=user, **data.validated_data)
        return Response(UserSerializer(user).data)


class TokenObtainView(APIView):
    """``POST /api/auth/token/`` ``{"username", "password"[, "name"]}``: a new API token for
    automation (no other authentication needed; JSON or form body). Each call issues another
    token (earlier ones stay valid until revoked in the admin); only its hash is stored, so
    the answer is the one time it can be read. Bad credentials: 400 ``non_field_errors``."""

    authentication_classes: list[Any] = []  # the password is the credential (and no CSRF)
    permission_classes = [AllowAny]
    parser_classes = [JSONParser, FormParser, MultiPartParser]

    @extend_schema(request=TokenObtainSerializer, responses={200: TokenIssuedSerializer})
    def post(self, request: Request) -> Response:
        data = TokenObtainSerializer(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        user = data.validated_data["user"]
        row, token = services_tokens.api_token_issue(
            actor=user, user=user, name=data.validated_data["name"]
        )
        return Response({"token": token, "token_prefix": row.token_prefix, "name": row.name})


@extend_schema(responses=UserSerializer)
@api_view(["GET"])
@permission_classes([IsAuthenticated])
def me(request: Request) -> Response:
    """The calling user and their role (any authenticated user, with or without a role)."""
    return Response(UserSerializer(request.user).data)


@extend_schema(exclude=True)
@api_view(["GET"])
@permission_classes([AllowAny])
def api_root(request: Request) -> Response:
    return Response({"schema": "/api/schema/", "docs": "/api/docs/"})
