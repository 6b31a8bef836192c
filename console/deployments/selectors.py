"""Deployment reads for the API and pages: which config snapshot a request asks for, ETag
handling, whether a node may read a deployment's config, and what an operator editing the
remote share should know about a canary in progress."""

from __future__ import annotations

from typing import Any

from django.http import Http404

from console.deployments.flows import CANARY_KIND, active_run
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


def canary_notice(deployment: Deployment) -> dict[str, Any] | None:
    """The pending or running canary of ``deployment`` for the deployment page's banner:
    ``{"run", "paused", "pause_reason"}``, or None."""
    run = active_run(deployment, CANARY_KIND)
    if run is None:
        return None
    params = run.params or {}
    return {
        "run": run,
        "paused": bool(params.get("paused")),
        "pause_reason": str(params.get("pause_reason") or ""),
    }


def share_edit_warnings(deployment: Deployment, *, before: int, after: int) -> list[str]:
    """What the answer to an edit of the remote share (update, restore) warns about: a canary
    in progress drives the share, and pauses instead of overwriting an edit. Empty when the
    share did not change or no canary is pending or running."""
    if before == after:
        return []
    canary = canary_notice(deployment)
    if canary is None:
        return []
    run = canary["run"]
    if canary["paused"]:
        return [
            f"Canary run #{run.pk} of {deployment.name} is paused: your {after} % stays. "
            "Resuming the canary lets it set its current step's share again; cancel the run "
            f"(POST /api/runs/{run.pk}/cancel/) to keep yours."
        ]
    return [
        f"Canary run #{run.pk} of {deployment.name} is in progress and drives the remote share: "
        f"it pauses at its next re-check and leaves your {after} % as set. Resume it "
        f"(POST /api/deployments/{deployment.pk}/canary/resume/) to let it set its step's "
        f"share again, or cancel the run (POST /api/runs/{run.pk}/cancel/) to keep yours."
    ]


def engine_drift(deployment: Deployment) -> list[dict[str, Any]]:
    """Where an active deployment's nodes differ from what it needs (desired state:
    ``config.wanted_children``; observed: each node's last heartbeat): ``{"site", "node",
    "child", "state"}`` per child not reported ``running`` -- ``absent`` (the reconcile loop launches
    it again), the state the agent reports (its own restarts handle it), or ``node <status>``
    when the node is not online (nothing known runs there). Empty for other states."""
    from console.deployments.choices import DeploymentState
    from console.deployments.config import build_config, wanted_children
    from console.inventory.choices import NodeStatus

    if deployment.state != DeploymentState.ACTIVE:
        return []
    wanted = wanted_children(build_config(deployment))
    # By site and hostname: the loopback testbed's nodes are all "localhost".
    nodes = {
        (n.site.name, n.hostname): n
        for n in Node.objects.select_related("site").filter(
            hostname__in={w["node"] for w in wanted}
        )
    }
    out = []
    for want in wanted:
        node = nodes.get((want["site"], want["node"]))
        if node is None or node.status != NodeStatus.ONLINE:
            state = f"node {node.status if node is not None else 'unknown'}"
        else:
            state = reported_children(node).get(want["child"], "absent")
            if state == "running":
                continue
        out.append(
            {"site": want["site"], "node": want["node"], "child": want["child"], "state": state}
        )
    return out


def reported_children(node: Node) -> dict[str, str]:
    """A node's children by name -> state, as its last heartbeat reported them."""
    return {
        str(c.get("name")): str(c.get("state"))
        for c in node.reported_children or []
        if isinstance(c, dict)
    }
