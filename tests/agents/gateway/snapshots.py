"""Deployment config snapshots shaped like the console's ``GET /api/deployments/{id}/config/``
(see the contract in docs/gateway.md), built for tests."""

from __future__ import annotations

import copy
from typing import Any


def snapshot(
    *,
    version: int = 3,
    decode_urls: tuple[str, ...] = ("http://127.0.0.1:9",),
    prefill_sites: dict[str, tuple[str, ...]] | None = None,
    kv_mode: str | None = None,
    **routing: Any,
) -> dict[str, Any]:
    """A valid snapshot; ``routing`` keys override the routing section; ``kv_mode`` sets
    ``kv_transfer.mode`` (absent: the gateway's default, push)."""
    sites = prefill_sites if prefill_sites is not None else {"remote": ("http://127.0.0.1:10",)}
    data: dict[str, Any] = {
        "deployment": {"id": 1, "name": "demo", "state": "active"},
        "version": version,
        "created_at": "2026-11-29T17:40:00Z",
        "model": {
            "name": "tiny",
            "weights_sha256": "0" * 64,
            "architecture_hash": "a" * 16,
            "engine_settings": {"max_model_len": 8192},
        },
        "routing": {
            "remote_prefill_threshold_tokens": 100,
            "remote_share_percent": 100,
            "kill_switch": False,
            "fallback_to_local_prefill": True,
            "link_utilization_ceiling": 0.7,
        },
        "circuit_breaker": {"error_rate_limit": 0.05, "latency_p99_limit_ms": 2500},
        "kv_transfer": {
            "chunk_size_mb": 32,
            "compression": "auto",
            "checksum": True,
            "retry": 3,
            "timeout_ms": 4000,
        },
        "prefill": {"chunked_prefill_tokens": 2048},
        "pools": {
            "decode": {
                "site": "local",
                "nodes": [
                    {
                        "hostname": f"dec-{i}",
                        "agent_address": "",
                        "engine_url": url,
                        "kv_address": f"127.0.0.1:{7100 + i}",
                    }
                    for i, url in enumerate(decode_urls)
                ],
                "engine_settings": {},
            },
            "prefill": [
                {
                    "site": name,
                    "nodes": [
                        {"hostname": f"{name}-pre-{i}", "agent_address": "", "engine_url": url}
                        for i, url in enumerate(urls)
                    ],
                    "engine_settings": {},
                }
                for name, urls in sites.items()
            ],
        },
        "links": [
            {
                "from_site": name,
                "to_site": "local",
                "provisioned_mbit_s": 100000,
                "measured_mbit_s": None,
                "rtt_ms": None,
                "utilization_ceiling": 0.7,
            }
            for name in sites
        ],
    }
    data["routing"].update(routing)
    if kv_mode is not None:
        data["kv_transfer"]["mode"] = kv_mode
    return copy.deepcopy(data)
