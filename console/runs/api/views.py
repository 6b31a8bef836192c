from __future__ import annotations

from typing import Any

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from console.core.api.base import ConsoleViewSetMixin
from console.core.choices import Role
from console.runs import selectors, services
from console.runs.api.serializers import (
    RunCreateSerializer,
    RunRetrySerializer,
    WorkflowRunSerializer,
)
from console.runs.models import WorkflowRun


class WorkflowRunFilter(django_filters.FilterSet):
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")

    class Meta:
        model = WorkflowRun
        fields = ["kind", "state", "target_type", "target_id"]


class WorkflowRunViewSet(
    ConsoleViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Workflow runs and their steps with evidence. Operators cancel and retry them."""

    queryset = selectors.run_list()
    serializer_class = WorkflowRunSerializer
    filterset_class = WorkflowRunFilter
    ordering_fields = ["id", "created_at"]
    ordering = ["-created_at", "-id"]
    write_role = Role.OPERATOR

    @extend_schema(request=RunCreateSerializer, responses={201: WorkflowRunSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = RunCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        kind = data.validated_data["kind"]
        run = services.run_create(
            actor=request.user,
            kind=kind,
            steps=selectors.standalone_steps(kind),
            params=data.validated_data["params"],
        )
        return Response(WorkflowRunSerializer(run).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={202: WorkflowRunSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        run = services.run_cancel(actor=request.user, run=self.get_object())
        return Response(WorkflowRunSerializer(run).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=RunRetrySerializer, responses={202: WorkflowRunSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        data = RunRetrySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = services.run_retry(
            actor=request.user,
            run=self.get_object(),
            from_index=data.validated_data.get("from_step"),
        )
        return Response(WorkflowRunSerializer(run).data, status=status.HTTP_202_ACCEPTED)
