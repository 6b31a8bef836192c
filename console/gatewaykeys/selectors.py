"""Reads: the access document a deployment's gateway polls (the contract in docs/api.md)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from console.deployments.models import Deployment
from console.gatewaykeys.models import GatewayAccess, GatewayKey


def access_document(deployment: Deployment) -> dict[str, Any]:
    """``{"deployment", "require_client_keys", "keys": [{"name", "sha256", "prefix"}]}`` with
    the deployment's active keys, by name."""
    access = GatewayAccess.objects.filter(deployment=deployment).first()
    keys = GatewayKey.objects.filter(deployment=deployment, revoked_at=None).order_by("name", "id")
    return {
        "deployment": deployment.pk,
        "require_client_keys": bool(access and access.require_client_keys),
        "keys": [{"name": k.name, "sha256": k.key_hash, "prefix": k.key_prefix} for k in keys],
    }


def access_etag(document: dict[str, Any]) -> str:
    """The document's ETag: a digest of its content (no version counter to keep)."""
    body = json.dumps(document, sort_keys=True).encode()
    return f'"{hashlib.sha256(body).hexdigest()[:20]}"'
