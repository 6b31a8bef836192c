from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from console.core.api.base import ConsoleReadOnlyViewSet, ServiceModelViewSet
from console.core.choices import Role
from console.drills import selectors, services
from console.drills.api.serializers import DrillReportSerializer, DrillSerializer
from console.drills.filtersets import DrillFilterSet, DrillReportFilterSet


class DrillViewSet(ServiceModelViewSet):
    """Drills. Viewers read; operators create (and by default run at once), change, delete,
    and run them again with ``POST /api/drills/{id}/run/``."""

    queryset = selectors.drill_list()
    serializer_class = DrillSerializer
    filterset_class = DrillFilterSet
    search_fields = ["name"]
    ordering_fields = ["id", "name"]
    write_role = Role.OPERATOR
    instance_kwarg = "drill"
    create_service = staticmethod(services.drill_create)
    update_service = staticmethod(services.drill_update)
    delete_service = staticmethod(services.drill_delete)

    def perform_create(self, serializer: Any) -> None:
        fields = dict(serializer.validated_data)
        run_now = fields.pop("run_now", True)
        drill = services.drill_create(actor=self.request.user, **fields)
        if run_now:
            services.drill_run(actor=self.request.user, drill=drill)
        serializer.instance = drill

    def perform_update(self, serializer: Any) -> None:
        fields = dict(serializer.validated_data)
        fields.pop("run_now", None)
        serializer.instance = services.drill_update(
            actor=self.request.user, drill=serializer.instance, **fields
        )

    @extend_schema(request=None, responses={202: DrillReportSerializer})
    @action(detail=True, methods=["post"])
    def run(self, request: Request, pk: str | None = None) -> Response:
        report = services.drill_run(actor=request.user, drill=self.get_object())
        return Response(DrillReportSerializer(report).data, status=status.HTTP_202_ACCEPTED)


class DrillReportViewSet(ConsoleReadOnlyViewSet):
    """Drill reports (viewers and up): figures, criteria results and the raw timeline."""

    queryset = selectors.report_list()
    serializer_class = DrillReportSerializer
    filterset_class = DrillReportFilterSet
    ordering_fields = ["id", "created_at"]
    ordering = ["-created_at", "-id"]
