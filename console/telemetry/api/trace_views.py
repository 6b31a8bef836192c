"""Request traces over the API: gateways ship them (``POST /api/telemetry/trace-batches/``,
node token), viewers read them (``/api/telemetry/traces/``, filter ``request_id``, ``path``,
``outcome``; one trace with its merged timeline)."""

from __future__ import annotations

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from console.core.api.base import ConsoleReadOnlyViewSet
from console.inventory.authentication import IsNode, NodeTokenAuthentication
from console.telemetry.api.trace_serializers import (
    RequestTraceDetailSerializer,
    RequestTraceSerializer,
    TraceBatchResultSerializer,
    TraceBatchSerializer,
)
from console.telemetry.models import RequestTrace
from console.telemetry.services import trace_record_batch


class RequestTraceFilter(django_filters.FilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="started_at", lookup_expr="gte")
    until = django_filters.IsoDateTimeFilter(field_name="started_at", lookup_expr="lt")

    class Meta:
        model = RequestTrace
        fields = ["request_id", "path", "outcome", "node"]


class RequestTraceViewSet(ConsoleReadOnlyViewSet):
    """Request traces shipped by gateways (read-only)."""

    queryset = RequestTrace.objects.select_related("node__site")
    serializer_class = RequestTraceSerializer
    filterset_class = RequestTraceFilter
    ordering_fields = ["id", "started_at", "total_ms"]
    ordering = ["-started_at", "-id"]

    def get_serializer_class(self) -> type:
        if self.action == "retrieve":
            return RequestTraceDetailSerializer
        return RequestTraceSerializer


class TraceBatchView(APIView):
    """``POST /api/telemetry/trace-batches/``: a gateway ships request traces (node token)."""

    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNode]

    @extend_schema(request=TraceBatchSerializer, responses={201: TraceBatchResultSerializer})
    def post(self, request: Request) -> Response:
        data = TraceBatchSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        stored = trace_record_batch(node=request.auth, traces=data.validated_data["traces"])
        return Response(
            TraceBatchResultSerializer({"stored": stored}).data, status=status.HTTP_201_CREATED
        )
