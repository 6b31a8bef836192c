"""Planner API: evaluate a scenario, size a model's KV against a link, list the presets.

Any role may use them (viewer and up): they compute, they change nothing. Each call is
synchronous and CPU-bound (milliseconds; a 1,000-threshold grid stays well under a second).
"""

from __future__ import annotations

import logging
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from console.core.api.base import ServiceModelViewSet
from console.core.api.pagination import StandardPagination
from console.core.choices import Role
from console.planner import services
from console.planner.api.serializers import (
    KvSizeSerializer,
    PlannerScenarioSerializer,
    ScenarioSerializer,
    field_error,
)
from console.planner.demand import transfer_demand
from console.planner.errors import PlannerInputError
from console.planner.model import evaluate
from console.planner.models import PlannerScenario
from console.planner.presets import preset_list

logger = logging.getLogger(__name__)


def _model_ref(model: Any) -> dict[str, Any]:
    return {"id": model.pk, "name": model.name}


def _sweeps(raw: str | None) -> bool:
    """``?sweeps=``: true unless ``false`` / ``0``; anything else is a 400 naming it."""
    if raw is None:
        return True
    value = raw.strip().lower()
    if value not in {"true", "1", "false", "0"}:
        raise ValidationError({"sweeps": ["Expected true or false."]})
    return value in {"true", "1"}


def _evaluate_body(request: Request, body: Any) -> dict[str, Any]:
    """Validate ``body``, evaluate it (``?sweeps=false`` leaves the sweeps out); a 400 naming
    the field on bad input."""
    with_sweeps = _sweeps(request.query_params.get("sweeps"))
    serializer = ScenarioSerializer(data=body)
    serializer.is_valid(raise_exception=True)
    try:
        result = evaluate(serializer.validated_data["scenario"], with_sweeps=with_sweeps)
    except PlannerInputError as exc:
        raise field_error(exc) from None
    model = serializer.validated_data["model"]
    if model is not None:
        result["profiles"]["kv"]["model"] = _model_ref(model)
    logger.info(
        "planner.evaluated",
        extra={
            "thresholds": result["grid"]["thresholds"],
            "lambda_max_rps": result["optimum"]["lambda_max_rps"],
            "decision": result["verdict"]["decision"],
        },
    )
    return result


class PlannerView(APIView):
    """Base: reads and computing POSTs both need only the viewer role."""

    read_role = Role.VIEWER
    write_role = Role.VIEWER


class EvaluateView(PlannerView):
    """``POST /api/planner/evaluate/``: optimum, baselines, gains, verdict and (unless
    ``?sweeps=false``) the sweeps over the threshold and the split."""

    @extend_schema(
        request=OpenApiTypes.OBJECT,
        responses=OpenApiTypes.OBJECT,
        parameters=[OpenApiParameter("sweeps", bool, description="Include chart sweeps.")],
    )
    def post(self, request: Request) -> Response:
        return Response(_evaluate_body(request, request.data))


class KvSizeView(PlannerView):
    """``POST /api/planner/kv-size/``: KV bytes per length, Gbit/s needed, share of the link."""

    @extend_schema(request=KvSizeSerializer, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request) -> Response:
        serializer = KvSizeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data: dict[str, Any] = dict(serializer.validated_data)
        model = data.pop("model", None)
        try:
            result = transfer_demand(**data)
        except PlannerInputError as exc:
            raise field_error(exc) from None
        result["model"] = _model_ref(model) if model is not None else None
        return Response(result)


class PresetsView(PlannerView):
    """``GET /api/planner/presets/``: shipped scenarios (the paper's case study) with the
    figures the paper reports, ready to POST to ``evaluate``."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        # Paginated like every other list, so clients read every list the same way.
        paginator = StandardPagination()
        page = paginator.paginate_queryset(preset_list(), request, view=self)
        return paginator.get_paginated_response(page)


class PlannerScenarioViewSet(ServiceModelViewSet):
    """Saved scenarios: everyone with a role reads and evaluates them, operators write them."""

    queryset = PlannerScenario.objects.select_related("created_by")
    serializer_class = PlannerScenarioSerializer
    filterset_fields = ["name"]
    search_fields = ["name", "description"]
    ordering_fields = ["id", "name", "updated_at"]
    action_roles = {"evaluate": Role.VIEWER}
    instance_kwarg = "scenario"
    create_service = staticmethod(services.scenario_create)
    update_service = staticmethod(services.scenario_update)
    delete_service = staticmethod(services.scenario_delete)

    @extend_schema(
        request=None,
        responses=OpenApiTypes.OBJECT,
        parameters=[OpenApiParameter("sweeps", bool, description="Include chart sweeps.")],
    )
    @action(detail=True, methods=["post"])
    def evaluate(self, request: Request, pk: str | None = None) -> Response:
        """Evaluate the saved body as ``POST /api/planner/evaluate/`` would."""
        scenario = self.get_object()
        result = _evaluate_body(request, scenario.body)
        result["scenario"] = {"id": scenario.pk, "name": scenario.name}
        return Response(result)
