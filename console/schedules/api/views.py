"""Schedules API: hourly price tables, tidal schedules with their what-if plan and the record
of what each hour applied, and rebalancing proposals. Viewers read (and may compute a
what-if, which changes nothing); operators write, apply and dismiss."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from console.core.api.base import ConsoleViewSetMixin, ServiceModelViewSet
from console.core.choices import Role
from console.schedules import rebalance, selectors, services
from console.schedules.api.serializers import (
    RebalanceProposalSerializer,
    RecordedCostQuerySerializer,
    SitePriceTableSerializer,
    TidalApplicationSerializer,
    TidalScheduleSerializer,
    WhatIfSerializer,
)
from console.schedules.filtersets import (
    RebalanceProposalFilterSet,
    TidalApplicationFilterSet,
    TidalScheduleFilterSet,
)
from console.schedules.models import (
    RebalanceProposal,
    SitePriceTable,
    TidalApplication,
    TidalSchedule,
)


class SitePriceTableViewSet(ServiceModelViewSet):
    """Per-site hourly GPU-hour prices (optionally energy per kWh x kW per GPU)."""

    queryset = SitePriceTable.objects.select_related("site")
    serializer_class = SitePriceTableSerializer
    filterset_fields = ["site"]
    write_role = Role.OPERATOR
    instance_kwarg = "table"
    create_service = staticmethod(services.price_table_create)
    update_service = staticmethod(services.price_table_update)
    delete_service = staticmethod(services.price_table_delete)


class TidalScheduleViewSet(ServiceModelViewSet):
    """Tidal schedules. ``GET .../what-if/`` plans the day from the stored inputs;
    ``POST .../what-if/`` plans it with overrides (nothing is saved); ``GET
    .../recorded-cost/`` prices the recorded traffic with and without the schedule."""

    queryset = TidalSchedule.objects.select_related("deployment", "remote_site", "local_site")
    serializer_class = TidalScheduleSerializer
    filterset_class = TidalScheduleFilterSet
    write_role = Role.OPERATOR
    action_roles = {"what_if": Role.VIEWER, "recorded_cost": Role.VIEWER}
    instance_kwarg = "schedule"
    create_service = staticmethod(services.tidal_schedule_create)
    update_service = staticmethod(services.tidal_schedule_update)
    delete_service = staticmethod(services.tidal_schedule_delete)

    @extend_schema(request=WhatIfSerializer, responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get", "post"], url_path="what-if")
    def what_if(self, request: Request, pk: str | None = None) -> Response:
        schedule = self.get_object()
        overrides: dict[str, Any] = {}
        if request.method == "POST":
            body = WhatIfSerializer(data=request.data)
            body.is_valid(raise_exception=True)
            overrides = dict(body.validated_data)
        return Response(services.tidal_what_if(schedule=schedule, overrides=overrides))

    @extend_schema(
        parameters=[
            OpenApiParameter("days", int, description="Days of recorded traffic (1-31, 7)."),
            OpenApiParameter(
                "static_remote_instances",
                int,
                description="Remote instances without the schedule (default: the pool's nodes).",
            ),
        ],
        responses=OpenApiTypes.OBJECT,
    )
    @action(detail=True, methods=["get"], url_path="recorded-cost")
    def recorded_cost(self, request: Request, pk: str | None = None) -> Response:
        """Cost per million tokens of the recorded traffic as scheduled and without the
        schedule, hour by hour (gaps where nothing was recorded) and in total."""
        schedule = self.get_object()
        query = RecordedCostQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        try:
            result = selectors.tidal_recorded_cost(
                schedule=schedule,
                days=query.validated_data["days"],
                static_instances=query.validated_data.get("static_remote_instances"),
            )
        except ValueError as exc:  # recorded.check_inputs: "<field>: <why>"
            field, _, message = str(exc).partition(": ")
            raise ValidationError({field: [message or field]}) from None
        return Response(result)


class TidalApplicationViewSet(ConsoleViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """What the beat applied, hour by hour (read-only history)."""

    queryset = TidalApplication.objects.all()
    serializer_class = TidalApplicationSerializer
    filterset_class = TidalApplicationFilterSet
    ordering_fields = ["id", "hour_start"]
    ordering = ["-hour_start", "-id"]


class RebalanceProposalViewSet(
    ConsoleViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Rebalancing proposals; operators apply or dismiss an open one (409 otherwise)."""

    queryset = RebalanceProposal.objects.all()
    serializer_class = RebalanceProposalSerializer
    filterset_class = RebalanceProposalFilterSet
    ordering_fields = ["id", "created_at"]
    ordering = ["-created_at", "-id"]
    write_role = Role.OPERATOR

    @extend_schema(request=None, responses=RebalanceProposalSerializer)
    @action(detail=True, methods=["post"])
    def apply(self, request: Request, pk: str | None = None) -> Response:
        proposal = rebalance.rebalance_apply(actor=request.user, proposal=self.get_object())
        return Response(RebalanceProposalSerializer(proposal).data)

    @extend_schema(request=None, responses=RebalanceProposalSerializer)
    @action(detail=True, methods=["post"])
    def dismiss(self, request: Request, pk: str | None = None) -> Response:
        proposal = rebalance.rebalance_dismiss(actor=request.user, proposal=self.get_object())
        return Response(RebalanceProposalSerializer(proposal).data)
