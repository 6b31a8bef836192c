from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.authentication import SessionAuthentication
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.generics import get_object_or_404
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response

from console.core.api.base import ServiceModelViewSet
from console.core.authentication import ApiTokenAuthentication
from console.core.choices import Role
from console.core.permissions import RolePermission
from console.deployments import flows, selectors, services
from console.deployments.api.serializers import (
    DeploymentEditedSerializer,
    DeploymentSerializer,
    EngineDriftSerializer,
    KillSwitchResponseSerializer,
    KillSwitchSerializer,
    PoolDrainSerializer,
    PoolSerializer,
    RestoreSerializer,
    SnapshotSerializer,
    WorkflowStartSerializer,
)
from console.deployments.choices import DeploymentState
from console.deployments.config import render_snapshot
from console.deployments.filtersets import DeploymentFilterSet, PoolFilterSet, SnapshotFilterSet
from console.deployments.models import ConfigSnapshot, Deployment, Pool
from console.inventory.authentication import NodeTokenAuthentication
from console.inventory.models import Node
from console.rollouts.api.serializers import RolloutPlanSerializer
from console.rollouts.services import rollout_plan_for
from console.runs.api.serializers import WorkflowRunSerializer


class ConfigReadPermission(BasePermission):
    """Config reads: any console role, or a node of one of the deployment's pools."""

    def has_permission(self, request: Any, view: Any) -> bool:
        if isinstance(request.auth, Node):
            return True
        return RolePermission().has_permission(request, view)

    def has_object_permission(self, request: Any, view: Any, obj: Any) -> bool:
        if isinstance(request.auth, Node) and not selectors.node_serves(request.auth, obj):
            raise PermissionDenied("This node is in none of the deployment's pools.")
        return True


def expected_version(request: Request) -> int | None:
    """The version a write names: ``If-Match: "<version>"`` or a body ``version``."""
    header = request.headers.get("If-Match")
    if header is not None:
        version = selectors.parse_version_tag(header)
        if version is None:
            raise ValidationError({"If-Match": ['Expected a version tag such as "3".']})
        return version
    body = request.data.get("version") if hasattr(request.data, "get") else None
    if body is None:
        return None
    version = selectors.parse_version_tag(body)
    if version is None:
        raise ValidationError({"version": ["Expected the integer version you last read."]})
    return version


class VersionedWriteMixin:
    """Pass the named version (If-Match / body) to update and delete services."""

    request: Request

    def service_kwargs(self) -> dict[str, Any]:
        return {"expected_version": expected_version(self.request)}


class DeploymentViewSet(VersionedWriteMixin, ServiceModelViewSet):
    """Deployments. Viewers read; operators write. Writes may name the version they were
    based on (``If-Match`` or ``version``); a stale one is a 409 with the current version."""

    queryset = Deployment.objects.select_related("model").prefetch_related(
        "pools__site", "pools__nodes"
    )
    serializer_class = DeploymentSerializer
    filterset_class = DeploymentFilterSet
    search_fields = ["name", "description"]
    ordering_fields = ["id", "name", "updated_at"]
    write_role = Role.OPERATOR
    instance_kwarg = "deployment"
    create_service = staticmethod(services.deployment_create)
    update_service = staticmethod(services.deployment_update)
    delete_service = staticmethod(services.deployment_delete)

    def get_queryset(self) -> Any:
        if self.action == "snapshots":  # the action's queryset: ConfigSnapshot
            return self.queryset.filter(deployment_id=self.kwargs.get("pk"))
        if self.action in {
            "config",
            "engines",
            "kill_switch",
            "restore",
            "retire",
            "deploy",
            "canary",
            "canary_pause",
            "canary_resume",
            "canary_abort",
        }:
            return Deployment.objects.all()  # these actions need the row only
        return super().get_queryset()

    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        response = super().retrieve(request, *args, **kwargs)
        response["ETag"] = selectors.etag(response.data["version"])
        return response

    def get_serializer_class(self) -> Any:
        if self.action in {"update", "partial_update"}:
            return DeploymentEditedSerializer
        return super().get_serializer_class()

    @extend_schema(request=DeploymentSerializer, responses=DeploymentEditedSerializer)
    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Change settings. The answer's ``warnings`` say when a canary in progress drives
        the remote share this edit changed (the canary pauses and keeps the edit)."""
        response = super().update(request, *args, **kwargs)
        response["ETag"] = selectors.etag(response.data["version"])
        return response

    @extend_schema(request=DeploymentSerializer, responses=DeploymentEditedSerializer)
    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Change some settings (see ``update``)."""
        return super().partial_update(request, *args, **kwargs)

    def perform_update(self, serializer: Any) -> None:
        before = serializer.instance.remote_share_percent
        super().perform_update(serializer)
        # The answer is rendered from the serializer after this: its context carries them.
        serializer.context["warnings"] = selectors.share_edit_warnings(
            serializer.instance, before=before, after=serializer.instance.remote_share_percent
        )

    @extend_schema(
        parameters=[
            OpenApiParameter("version", OpenApiTypes.INT, description="An earlier version."),
            OpenApiParameter("If-None-Match", OpenApiTypes.STR, OpenApiParameter.HEADER),
        ],
        responses={200: OpenApiTypes.OBJECT, 304: OpenApiResponse(description="Not modified")},
    )
    @action(
        detail=True,
        methods=["get"],
        authentication_classes=[
            NodeTokenAuthentication,
            ApiTokenAuthentication,
            SessionAuthentication,
        ],
        permission_classes=[ConfigReadPermission],
        filter_backends=[],  # the hot polling path: list filters do not apply to one object
    )
    def config(self, request: Request, pk: str | None = None) -> Response:
        """The config document data-plane components poll (docs/api.md). ``ETag`` is the
        version; ``If-None-Match`` with it answers 304 without a body."""
        deployment = self.get_object()
        raw = request.query_params.get("version")
        version = None
        if raw is not None:
            if not (raw.isascii() and raw.isdigit()):
                raise ValidationError({"version": ["Expected a positive integer."]})
            version = int(raw)
        if_none_match = request.headers.get("If-None-Match", "")
        if version is None and selectors.etag_matches(if_none_match, deployment.version):
            # The common poll: answered from the deployment row, no snapshot read.
            tag = selectors.etag(deployment.version)
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": tag})
        snapshot = selectors.snapshot_for(deployment, version)
        tag = selectors.etag(snapshot.version)
        if selectors.etag_matches(if_none_match, snapshot.version):
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": tag})
        return Response(render_snapshot(snapshot), headers={"ETag": tag})

    @extend_schema(responses=SnapshotSerializer(many=True))
    @action(
        detail=True,
        methods=["get"],
        queryset=ConfigSnapshot.objects.all(),
        filterset_class=SnapshotFilterSet,
        ordering_fields=["version", "created_at"],
        ordering=["-version"],
        search_fields=["author_label", "reason"],
    )
    def snapshots(self, request: Request, pk: str | None = None) -> Response:
        """Config history, newest first, each with its diff against the one before."""
        # The deployment is looked up unfiltered: this action's filters are the snapshots'.
        deployment = get_object_or_404(Deployment.objects.all(), pk=pk)
        self.check_object_permissions(request, deployment)
        snapshots = self.filter_queryset(self.get_queryset())
        page = self.paginate_queryset(snapshots)
        return self.get_paginated_response(SnapshotSerializer(page, many=True).data)

    @extend_schema(request=RestoreSerializer, responses=DeploymentEditedSerializer)
    @action(detail=True, methods=["post"])
    def restore(self, request: Request, pk: str | None = None) -> Response:
        """Make an earlier version current again (as a new version); ``warnings`` as for an
        update when the restored share differs and a canary is in progress."""
        deployment = self.get_object()
        before = deployment.remote_share_percent
        data = RestoreSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        header = request.headers.get("If-Match")
        expected = selectors.parse_version_tag(header) if header is not None else None
        if header is not None and expected is None:
            raise ValidationError({"If-Match": ['Expected a version tag such as "3".']})
        deployment = services.deployment_restore(
            actor=request.user,
            deployment=deployment,
            version=data.validated_data["version"],
            expected_version=expected,
        )
        warnings = selectors.share_edit_warnings(
            deployment, before=before, after=deployment.remote_share_percent
        )
        body = DeploymentEditedSerializer(
            self.queryset.get(pk=deployment.pk), context={"warnings": warnings}
        ).data
        return Response(body, headers={"ETag": selectors.etag(deployment.version)})

    @extend_schema(request=KillSwitchSerializer, responses=KillSwitchResponseSerializer)
    @action(detail=True, methods=["post"], url_path="kill-switch")
    def kill_switch(self, request: Request, pk: str | None = None) -> Response:
        """Send everything local (``enabled: true``) or allow remote prefill again."""
        deployment = self.get_object()
        data = KillSwitchSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        deployment = services.deployment_set_kill_switch(
            actor=request.user, deployment=deployment, enabled=data.validated_data["enabled"]
        )
        body = {"kill_switch": deployment.kill_switch, "version": deployment.version}
        return Response(body, headers={"ETag": selectors.etag(deployment.version)})

    @extend_schema(request=None, responses=EngineDriftSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def engines(self, request: Request, pk: str | None = None) -> Response:
        """Where the active deployment's nodes differ from what it needs (desired children
        against their heartbeats): empty when everything runs. An ``absent`` child is launched
        again by the reconcile loop (docs/orchestrator.md)."""
        drift = selectors.engine_drift(self.get_object())
        return Response(EngineDriftSerializer(drift, many=True).data)

    @extend_schema(request=None, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def retire(self, request: Request, pk: str | None = None) -> Response:
        """Take the deployment out of service for good (then it may be deleted)."""
        deployment = services.deployment_transition(
            actor=request.user, deployment=self.get_object(), to_state=DeploymentState.RETIRED
        )
        return Response(DeploymentSerializer(self.queryset.get(pk=deployment.pk)).data)

    @extend_schema(request=WorkflowStartSerializer, responses={202: WorkflowRunSerializer})
    @action(detail=True, methods=["post"])
    def deploy(self, request: Request, pk: str | None = None) -> Response:
        """Start the eight-step deployment workflow (409 while one runs)."""
        return self._start(request, flows.deployment_deploy)

    @extend_schema(request=WorkflowStartSerializer, responses={202: WorkflowRunSerializer})
    @action(detail=True, methods=["post"])
    def canary(self, request: Request, pk: str | None = None) -> Response:
        """Start a canary that follows the deployment's rollout plan (409 while one runs)."""
        return self._start(request, flows.canary_start)

    def _start(self, request: Request, service: Any) -> Response:
        data = WorkflowStartSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = service(
            actor=request.user, deployment=self.get_object(), params=data.validated_data["params"]
        )
        return Response(WorkflowRunSerializer(run).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses=WorkflowRunSerializer)
    @action(detail=True, methods=["post"], url_path="canary/pause")
    def canary_pause(self, request: Request, pk: str | None = None) -> Response:
        """Hold the running canary at its current share."""
        run = flows.canary_pause(actor=request.user, deployment=self.get_object())
        return Response(WorkflowRunSerializer(run).data)

    @extend_schema(request=None, responses=WorkflowRunSerializer)
    @action(detail=True, methods=["post"], url_path="canary/resume")
    def canary_resume(self, request: Request, pk: str | None = None) -> Response:
        """Let a paused canary advance again."""
        run = flows.canary_resume(actor=request.user, deployment=self.get_object())
        return Response(WorkflowRunSerializer(run).data)

    @extend_schema(request=None, responses={202: WorkflowRunSerializer})
    @action(detail=True, methods=["post"], url_path="canary/abort")
    def canary_abort(self, request: Request, pk: str | None = None) -> Response:
        """Remote share to 0 % now; the canary run ends canceled."""
        run = flows.canary_abort(actor=request.user, deployment=self.get_object())
        return Response(WorkflowRunSerializer(run).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses=RolloutPlanSerializer)
    @action(detail=True, methods=["get"], url_path="rollout-plan")
    def rollout_plan(self, request: Request, pk: str | None = None) -> Response:
        """The rollout plan that applies: the deployment's own, else the default."""
        return Response(RolloutPlanSerializer(rollout_plan_for(self.get_object())).data)


class PoolViewSet(VersionedWriteMixin, ServiceModelViewSet):
    """Pools of a deployment. Operators write; each change is a new deployment version
    (``If-Match`` names the deployment's version)."""

    queryset = Pool.objects.select_related("deployment", "site").prefetch_related("nodes")
    serializer_class = PoolSerializer
    filterset_class = PoolFilterSet
    write_role = Role.OPERATOR
    instance_kwarg = "pool"
    create_service = staticmethod(services.pool_create)
    update_service = staticmethod(services.pool_update)
    delete_service = staticmethod(services.pool_delete)

    action_roles = {"drain": Role.OPERATOR}

    @extend_schema(request=PoolDrainSerializer, responses=PoolSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        """Take nodes out of the gateways' rotation (``drain``) or put them back (``rejoin``):
        a new config version; in-flight legs finish. Nothing is stopped."""
        pool = self.get_object()
        body = PoolDrainSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.pool_set_drained(actor=request.user, pool=pool, **body.validated_data)
        pool.refresh_from_db()
        return Response(PoolSerializer(pool, context={"request": request}).data)

    def perform_create(self, serializer: Any) -> None:
        serializer.instance = services.pool_create(
            actor=self.request.user,
            expected_version=expected_version(self.request),
            **serializer.validated_data,
        )
