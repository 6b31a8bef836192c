from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from console.core.api.base import ServiceModelViewSet
from console.core.api.schema import ErrorSerializer
from console.core.choices import Role
from console.inventory import agentlogs, services
from console.inventory.api.serializers import (
    HeartbeatResponseSerializer,
    HeartbeatSerializer,
    LinkSerializer,
    LogExcerptSerializer,
    LogQuerySerializer,
    NodeSerializer,
    NodeTokenSerializer,
    SiteSerializer,
)
from console.inventory.authentication import IsNode, NodeTokenAuthentication
from console.inventory.filtersets import LinkFilterSet, NodeFilterSet, SiteFilterSet
from console.inventory.models import Link, Node, Site


class SiteViewSet(ServiceModelViewSet):
    """Sites (datacenters). Everyone with a role reads; admins write."""

    queryset = Site.objects.all()
    serializer_class = SiteSerializer
    filterset_class = SiteFilterSet
    search_fields = ["name", "region", "notes"]
    ordering_fields = ["id", "name"]
    write_role = Role.ADMIN
    instance_kwarg = "site"
    create_service = staticmethod(services.site_create)
    update_service = staticmethod(services.site_update)
    delete_service = staticmethod(services.site_delete)


class NodeViewSet(ServiceModelViewSet):
    """Nodes. Liveness fields come from heartbeats and are read-only. Admins write and issue
    node tokens."""

    queryset = Node.objects.select_related("site", "credential")
    serializer_class = NodeSerializer
    filterset_class = NodeFilterSet
    search_fields = ["hostname", "agent_address"]
    ordering_fields = ["id", "hostname", "last_heartbeat_at"]
    write_role = Role.ADMIN
    # Reading a process's log: a live agent call, and a log holds what a trace does not.
    action_roles = {"token": Role.ADMIN, "logs": Role.OPERATOR}
    instance_kwarg = "node"
    create_service = staticmethod(services.node_create)
    update_service = staticmethod(services.node_update)
    delete_service = staticmethod(services.node_delete)

    @extend_schema(request=None, responses={201: NodeTokenSerializer})
    @action(detail=True, methods=["post"])
    def token(self, request: Request, pk: str | None = None) -> Response:
        """Issue a new node token, revoking the previous one. The token is in this answer
        only; the console keeps its hash."""
        node = self.get_object()
        token = services.node_token_issue(actor=request.user, node=node)
        body = {"node": node.pk, "token": token, "token_prefix": token[:8]}
        return Response(NodeTokenSerializer(body).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[LogQuerySerializer],
        responses={
            200: LogExcerptSerializer,
            404: OpenApiResponse(
                ErrorSerializer, "No such node, or the agent supervises no such process."
            ),
            502: OpenApiResponse(
                ErrorSerializer, "The agent refused or failed (its status named)."
            ),
            503: OpenApiResponse(ErrorSerializer, "The console has no controller identity."),
            504: OpenApiResponse(ErrorSerializer, "The agent did not answer in time."),
        },
    )
    @action(
        detail=True,
        methods=["get"],
        # No {m,n} in the route: the schema generator would read it as a path parameter.
        url_path=r"logs/(?P<child>[A-Za-z0-9][A-Za-z0-9._-]*)",
        filter_backends=[],
        pagination_class=None,
    )
    def logs(self, request: Request, pk: str | None = None, child: str = "") -> Response:
        """Whole lines of one supervised process's log, read through the node's agent: the
        last ``size`` bytes (before ``before``), those containing ``q`` when given."""
        node = self.get_object()
        if not agentlogs.CHILD_NAME.match(child):
            raise NotFound("child: not a process name (at most 128 characters)")
        query = LogQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        try:
            excerpt = agentlogs.read_log(
                address=node.agent_address,
                hostname=node.hostname,
                child=child,
                size=agentlogs.SIZES[query.validated_data["size"]],
                before=query.validated_data.get("before"),
                search=query.validated_data["q"],
            )
        except agentlogs.LogUnavailable as exc:
            return Response({"detail": exc.message}, status=exc.status)
        body = {"node": node.pk, "child": child, **vars(excerpt)}
        return Response(LogExcerptSerializer(body).data)


class LinkViewSet(ServiceModelViewSet):
    """WAN links between sites. Admins write (probes record measurements through the same
    endpoint with an admin token)."""

    queryset = Link.objects.select_related("from_site", "to_site")
    serializer_class = LinkSerializer
    filterset_class = LinkFilterSet
    write_role = Role.ADMIN
    instance_kwarg = "link"
    create_service = staticmethod(services.link_create)
    update_service = staticmethod(services.link_update)
    delete_service = staticmethod(services.link_delete)


class HeartbeatView(APIView):
    """``POST /api/heartbeats/``: a node agent reports it is alive (node token only)."""

    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNode]

    @extend_schema(request=HeartbeatSerializer, responses=HeartbeatResponseSerializer)
    def post(self, request: Request) -> Response:
        data = HeartbeatSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.node_heartbeat(node=request.auth, **data.validated_data)
        return Response(HeartbeatResponseSerializer(result).data)
