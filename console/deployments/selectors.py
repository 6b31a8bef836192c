"""Deployment reads for the API: which config snapshot a request asks for, ETag handling and
whether a node may read a deployment's config."""

from __future__ import annotations

from django.http import Http404

from console.deployments.models import ConfigSnapshot, Deployment
from console.inventory.models import Node


def snapshot_for(deployment: Deployment, version: int | None) -> ConfigSnapshot:
    """The requested version (current when None); ``Http404`` when it does not exist."""
    wanted = deployment.version if version is None else version
    snapshot = deployment.snapshots.filter(version=wanted).first()
    if snapshot is None:
        raise Http404(f"Deployment {deployment.name} has no version {wanted}.")
    return snapshot


def etag(version: int) -> str:
    """The strong ETag of a config version."""
    return f'"{version}"'


def etag_matches(header: str, version: int) -> bool:
    """Whether an ``If-None-Match`` header names ``version`` (weak tags and ``*`` included)."""
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        tag = tag.removeprefix("W/")
        if tag == etag(version):
            return True
    return False


def parse_version_tag(raw: object) -> int | None:
    """An ``If-Match`` value or body ``version`` as an int (``"3"``, ``W/"3"``, ``3``), None
    when it is not one."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw if raw >= 0 else None
    if not isinstance(raw, str):
        return None
    text = raw.strip().removeprefix("W/").strip('"')
    # isascii: "²".isdigit() is true, but int("²") raises.
    return int(text) if text.isascii() and text.isdigit() else None


def node_serves(node: Node, deployment: Deployment) -> bool:
    """Whether ``node`` is in one of the deployment's pools (so may read its config)."""
    return deployment.pools.filter(nodes=node).exists()
