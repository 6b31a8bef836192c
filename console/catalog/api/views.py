from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from console.catalog import selectors, services
from console.catalog.api.serializers import KvSizeSerializer, ModelSpecSerializer
from console.catalog.filtersets import ModelSpecFilterSet
from console.catalog.models import ModelSpec
from console.core.api.base import ServiceModelViewSet
from console.core.choices import Role

KV_SIZE_PARAMETERS = [
    OpenApiParameter(
        "tokens",
        OpenApiTypes.STR,
        description="Comma-separated prompt lengths (default 1024,4096,32768,131072).",
    ),
    OpenApiParameter("baseline", OpenApiTypes.INT, description="Id of a model to compare against."),
]


class ModelSpecViewSet(ServiceModelViewSet):
    """Models. Everyone with a role reads; admins write (a model's weights identity is part of
    every node's trust in the KV it receives, so it is an admin matter like credentials)."""

    queryset = ModelSpec.objects.all()
    serializer_class = ModelSpecSerializer
    filterset_class = ModelSpecFilterSet
    search_fields = ["name", "family"]
    ordering_fields = ["id", "name", "parameter_count"]
    write_role = Role.ADMIN
    instance_kwarg = "model"
    create_service = staticmethod(services.model_create)
    update_service = staticmethod(services.model_update)
    delete_service = staticmethod(services.model_delete)

    def _kv_query(self, request: Request) -> tuple[list[int], ModelSpec | None]:
        try:
            tokens = selectors.parse_tokens(request.query_params.get("tokens"))
        except ValueError as exc:
            raise ValidationError({"tokens": [str(exc)]}) from None
        raw = request.query_params.get("baseline")
        if raw is None:
            return tokens, None
        baseline = (
            ModelSpec.objects.filter(pk=int(raw)).first()
            if raw.isascii() and raw.isdigit()
            else None
        )
        if baseline is None:
            raise ValidationError({"baseline": [f"No model with id {raw!r}."]})
        return tokens, baseline

    @extend_schema(parameters=KV_SIZE_PARAMETERS, responses=KvSizeSerializer)
    @action(detail=True, methods=["get"], url_path="kv-size")
    def kv_size(self, request: Request, pk: str | None = None) -> Response:
        """KV bytes per request at the given lengths, against the dense equivalent (and a
        baseline model when ``baseline`` names one)."""
        model = self.get_object()
        tokens, baseline = self._kv_query(request)
        return Response(KvSizeSerializer(selectors.model_kv_sizes(model, tokens, baseline)).data)

    @extend_schema(parameters=KV_SIZE_PARAMETERS, responses=KvSizeSerializer(many=True))
    @action(detail=False, methods=["get"], url_path="kv-size")
    def kv_size_all(self, request: Request) -> Response:
        """The same for every model in the (filtered, paginated) list: the side-by-side view
        (``?tokens=32768&baseline=<dense model id>``)."""
        tokens, baseline = self._kv_query(request)
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        rows = [selectors.model_kv_sizes(model, tokens, baseline) for model in page or []]
        return self.get_paginated_response(KvSizeSerializer(rows, many=True).data)
