from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from console.core.api.base import ServiceModelViewSet
from console.core.choices import Role
from console.inventory import services
from console.inventory.api.serializers import (
    HeartbeatResponseSerializer,
    HeartbeatSerializer,
    LinkSerializer,
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
    action_roles = {"token": Role.ADMIN}
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
