"""The deployment config document (the console/data-plane contract in docs/api.md): built
from the database rows, compared, diffed and rendered. Pure reads; called by the services
when they write a snapshot and by the config endpoint when it renders one."""

from __future__ import annotations

from typing import Any

from django.db.models import Q

from console.deployments.choices import PoolRole
from console.deployments.models import ConfigSnapshot, Deployment
from console.inventory.models import Link

SECTION_ORDER = ("model", "routing", "circuit_breaker", "kv_transfer", "prefill", "pools", "links")


def _node_doc(node: Any, drained: set[int]) -> dict[str, Any]:
    doc: dict[str, Any] = {"hostname": node.hostname, "agent_address": node.agent_address}
    if node.pk in drained:
        # Present only when true: gateways send this node no new leg (docs/api.md).
        doc["drained"] = True
    return doc


def _pool_doc(pool: Any) -> dict[str, Any]:
    nodes = sorted(pool.nodes.all(), key=lambda n: n.hostname)
    drained = {n.pk for n in pool.drained_nodes.all()}
    return {
        "site": pool.site.name,
        "nodes": [_node_doc(n, drained) for n in nodes],
        "engine_settings": pool.engine_settings,
    }


def child_name(deployment_id: int, part: str) -> str:
    """The name a deployment's child (``prefill``, ``decode``, ``gateway``, ``kvlink``) has on
    its node's agent; heartbeats report children by it."""
    return f"dep{deployment_id}-{part}"


#: What a deployment runs on the nodes of a pool: (child part, agent kind) by pool role.
POOL_CHILDREN = {
    "decode": (("decode", "decode-engine"), ("gateway", "gateway")),
    "prefill": (("prefill", "prefill-engine"),),
}


def wanted_children(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The children a config document says should run, node by node (desired state): on each
    decode node its decode engine and gateway, and the kv-link on the first decode node (as
    the deploy workflow launches it); on each prefill node its prefill engine -- except on
    nodes drained from their pool (a tidal hour or an operator stopped them on purpose). Each
    ``{"role", "site", "node", "part", "kind", "child"}``."""
    deployment_id = int(config["deployment"]["id"])
    pools = [("decode", config["pools"]["decode"])]
    pools += [("prefill", pool) for pool in config["pools"]["prefill"]]
    out: list[dict[str, Any]] = []
    first_decode = True
    for role, pool in pools:
        if not pool:
            continue
        for node in pool["nodes"]:
            parts = list(POOL_CHILDREN[role])
            if role == "decode" and first_decode:
                parts.append(("kvlink", "kv-link"))
                first_decode = False
            if node.get("drained"):
                continue
            out += [
                {"role": role, "site": pool["site"], "node": node["hostname"], "part": part,
                 "kind": kind, "child": child_name(deployment_id, part)}
                for part, kind in parts
            ]  # fmt: skip
    return out


def resolve_allowed_peers(prefill_docs: list[dict[str, Any]], extra: list[str]) -> list[str]:
    """Who may send KV to the deployment's receivers (the decode engines' KV listeners and the
    kv-link): every prefill pool's node by its hostname -- the name its certificate carries,
    as the orchestrator already checks when it dials that node's agent -- and the operator's
    ``extra_allowed_peers``; sorted, each once."""
    nodes = {node["hostname"] for pool in prefill_docs for node in pool["nodes"]}
    return sorted(nodes | set(extra))


def build_config(deployment: Deployment) -> dict[str, Any]:
    """The config document for the deployment's current rows (without ``version`` and
    ``created_at``, which belong to the snapshot)."""
    pools = list(
        deployment.pools.select_related("site")
        .prefetch_related("nodes", "drained_nodes")
        .order_by("id")
    )
    decode = next((p for p in pools if p.role == PoolRole.DECODE), None)
    prefill = sorted((p for p in pools if p.role == PoolRole.PREFILL), key=lambda p: p.site.name)
    site_ids = {p.site_id for p in pools}
    links = (
        Link.objects.select_related("from_site", "to_site")
        .filter(Q(from_site_id__in=site_ids) & Q(to_site_id__in=site_ids))
        .order_by("from_site__name", "to_site__name")
    )
    model = deployment.model
    prefill_docs = [_pool_doc(p) for p in prefill]
    extra = list(deployment.extra_allowed_peers or [])
    return {
        "deployment": {"id": deployment.pk, "name": deployment.name, "state": deployment.state},
        "model": {
            "name": model.name,
            "weights_sha256": model.weights_sha256,
            "architecture_hash": model.architecture_hash,
            "engine_settings": model.engine_settings,
        },
        "routing": {
            "remote_prefill_threshold_tokens": deployment.remote_prefill_threshold_tokens,
            "remote_share_percent": deployment.remote_share_percent,
            "kill_switch": deployment.kill_switch,
            "fallback_to_local_prefill": deployment.fallback_to_local_prefill,
            "link_utilization_ceiling": deployment.link_utilization_ceiling,
        },
        "circuit_breaker": {
            "error_rate_limit": deployment.error_rate_limit,
            "latency_p99_limit_ms": deployment.latency_p99_limit_ms,
        },
        "kv_transfer": {
            "chunk_size_mb": deployment.chunk_size_mb,
            "compression": deployment.compression,
            "checksum": deployment.checksum,
            "retry": deployment.retry,
            "timeout_ms": deployment.timeout_ms,
            "mode": deployment.kv_mode,
            "extra_allowed_peers": extra,
            # Resolved: what the orchestrator passes to every KV receiver it launches.
            "allowed_peers": resolve_allowed_peers(prefill_docs, extra),
        },
        "prefill": {"chunked_prefill_tokens": deployment.chunked_prefill_tokens},
        "pools": {
            "decode": _pool_doc(decode) if decode else None,
            "prefill": prefill_docs,
        },
        "links": [
            {
                "from_site": link.from_site.name,
                "to_site": link.to_site.name,
                "provisioned_mbit_s": link.provisioned_mbit_s,
                "measured_mbit_s": link.measured_mbit_s,
                "rtt_ms": link.rtt_ms,
                "utilization_ceiling": link.utilization_ceiling,
            }
            for link in links
        ],
    }


def config_diff(old: dict[str, Any] | None, new: dict[str, Any], prefix: str = "") -> dict:
    """Dotted path -> ``{"from": a, "to": b}`` for every leaf that differs (objects are
    walked, lists compared whole). Against no previous config, everything is new."""
    diff: dict[str, Any] = {}
    old = old or {}
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}{key}"
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diff.update(config_diff(a, b, prefix=f"{path}."))
        elif a != b:
            diff[path] = {"from": a, "to": b}
    return diff


def render_snapshot(snapshot: ConfigSnapshot) -> dict[str, Any]:
    """The response body of ``GET /api/deployments/{id}/config/``: the stored document with
    its version and creation time, keys in contract order."""
    config = snapshot.config
    body: dict[str, Any] = {
        "deployment": config["deployment"],
        "version": snapshot.version,
        "created_at": snapshot.created_at.isoformat().replace("+00:00", "Z"),
    }
    # jsonb does not keep key order; emit the contract's order, then anything newer.
    body.update({k: config[k] for k in SECTION_ORDER if k in config})
    body.update({k: v for k, v in config.items() if k not in body})
    return body
