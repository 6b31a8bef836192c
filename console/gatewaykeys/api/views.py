"""Gateway keys API. Keys: viewers list them (names and prefixes, never hashes); admins create
(the answer carries the key, the only time) and revoke. The access document: what a
deployment's gateway polls (its nodes, or any role), its policy set by admins."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.authentication import SessionAuthentication
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from console.core.api.base import ConsoleViewSetMixin
from console.core.api.schema import ValidationErrorSerializer
from console.core.authentication import ApiTokenAuthentication
from console.core.choices import Role
from console.core.permissions import RolePermission
from console.deployments.api.views import ConfigReadPermission
from console.deployments.models import Deployment
from console.gatewaykeys import selectors, services
from console.gatewaykeys.api.serializers import (
    AccessDocumentSerializer,
    GatewayAccessSerializer,
    GatewayKeyCreatedSerializer,
    GatewayKeyCreateSerializer,
    GatewayKeySerializer,
)
from console.gatewaykeys.filtersets import GatewayKeyFilterSet
from console.gatewaykeys.models import GatewayKey
from console.inventory.authentication import NodeTokenAuthentication


class GatewayKeyViewSet(
    ConsoleViewSetMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Client API keys of the deployments' gateways."""

    queryset = GatewayKey.objects.select_related("created_by", "revoked_by")
    serializer_class = GatewayKeySerializer
    filterset_class = GatewayKeyFilterSet
    search_fields = ["name", "key_prefix"]
    ordering_fields = ["id", "name", "created_at"]
    write_role = Role.ADMIN

    @extend_schema(request=GatewayKeyCreateSerializer, responses={201: GatewayKeyCreatedSerializer})
    def create(self, request: Request) -> Response:
        """Create a key; the answer holds the key itself, shown this once."""
        data = GatewayKeyCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        row, key = services.gateway_key_create(actor=request.user, **data.validated_data)
        body = GatewayKeyCreatedSerializer(row).data
        body["key"] = key
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=None,
        responses={
            200: GatewayKeySerializer,
            400: OpenApiResponse(ValidationErrorSerializer, "Already revoked (`revoked_at`)."),
        },
    )
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Revoke a key; the deployment's gateway refuses it from its next poll on."""
        key = services.gateway_key_revoke(actor=request.user, key=self.get_object())
        return Response(GatewayKeySerializer(key).data)


class AccessWritePermission(ConfigReadPermission):
    """Reads as the config document (the deployment's nodes, any role); writes by admins."""

    def has_permission(self, request: Any, view: Any) -> bool:
        if request.method == "GET":
            return super().has_permission(request, view)
        return RolePermission().has_permission(request, view)


class DeploymentAccessViewSet(ConsoleViewSetMixin, viewsets.GenericViewSet):
    """``/api/deployments/{id}/gateway-access/``: the access document the deployment's gateway
    polls (``ETag`` / ``If-None-Match`` -> 304), and the deployment's key policy (admins)."""

    queryset = Deployment.objects.all()
    filter_backends: list[Any] = []  # one object: list filters do not apply
    write_role = Role.ADMIN

    @extend_schema(
        methods=["GET"],
        responses={200: AccessDocumentSerializer, 304: OpenApiResponse(description="Not modified")},
    )
    @extend_schema(
        methods=["PUT"], request=GatewayAccessSerializer, responses=AccessDocumentSerializer
    )
    @action(
        detail=True,
        methods=["get", "put"],
        url_path="gateway-access",
        authentication_classes=[
            NodeTokenAuthentication,
            ApiTokenAuthentication,
            SessionAuthentication,
        ],
        permission_classes=[AccessWritePermission],
    )
    def gateway_access(self, request: Request, pk: str | None = None) -> Response:
        """GET: the deployment's active key hashes and ``require_client_keys``. PUT: require
        client keys (``true``) or not (``false``) at the deployment's gateway."""
        deployment = self.get_object()
        if request.method == "PUT":
            data = GatewayAccessSerializer(data=request.data)
            data.is_valid(raise_exception=True)
            services.gateway_access_update(
                actor=request.user, deployment=deployment, **data.validated_data
            )
        document = selectors.access_document(deployment)
        tag = selectors.access_etag(document)
        seen = [t.strip() for t in request.headers.get("If-None-Match", "").split(",")]
        if request.method == "GET" and tag in seen:
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": tag})
        return Response(document, headers={"ETag": tag})
