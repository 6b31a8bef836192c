"""Node authentication: agents send ``Authorization: Bearer <node-token>`` (issued by an
admin with ``POST /api/nodes/{id}/token/``). Used by the heartbeat and config endpoints only.
A bad token is a 401; a missing one leaves the request anonymous (401 from the permission)."""

from __future__ import annotations

from typing import Any

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission

from console.inventory.models import Node
from console.inventory.services import node_for_token


class NodePrincipal:
    """``request.user`` for a node: authenticated, holding no console role (so every
    role-checked endpoint answers 403 to it)."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_superuser = False
    is_staff = False
    pk = None

    def __init__(self, node: Node) -> None:
        self.node = node
        self._pdbridge_group_names: set[str] = set()  # no role (see console.core.roles)

    def get_username(self) -> str:
        return f"node:{self.node.hostname}"

    def __str__(self) -> str:
        return self.get_username()


class NodeTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer <token>`` -> ``(NodePrincipal, Node)``."""

    keyword = "bearer"

    def authenticate(self, request: Any) -> tuple[NodePrincipal, Node] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword.encode():
            return None
        if len(parts) != 2:
            raise AuthenticationFailed("Invalid Authorization header: expected 'Bearer <token>'.")
        try:
            token = parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationFailed("Invalid node token.") from None
        node = node_for_token(token)
        if node is None:
            raise AuthenticationFailed("Invalid node token.")
        return NodePrincipal(node), node

    def authenticate_header(self, request: Any) -> str:
        return 'Bearer realm="pdbridge-node"'


class IsNode(BasePermission):
    """Only an authenticated node."""

    message = "A node token is required."

    def has_permission(self, request: Any, view: Any) -> bool:
        return isinstance(request.auth, Node)
