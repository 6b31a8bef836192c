"""OpenAPI description of node authentication (imported by the app's ``ready``)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class NodeTokenScheme(OpenApiAuthenticationExtension):
    target_class = "console.inventory.authentication.NodeTokenAuthentication"
    name = "nodeToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "Node token from POST /api/nodes/{id}/token/ (agents only).",
        }
