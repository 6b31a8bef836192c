"""``Probe``: bandwidth and RTT to a peer site's kv-link through grpc_kv's probe.

The measurement itself belongs to grpc_kv (``grpc_kv.probe``); the agent only validates the
request and runs it with its own TLS material. Until grpc_kv ships its probe on this node the
call answers FAILED_PRECONDITION saying so.
"""

from __future__ import annotations

import importlib
from typing import Any

from agents.config import AgentConfig, split_host_port
from agents.launch import LaunchError


async def probe_peer(
    peer_site: str, address: str, size: int, rounds: int, config: AgentConfig
) -> dict[str, Any]:
    """Returns ``{bandwidth_mbit_s, rtt_ms, detail}``; LaunchError naming the field on bad
    input or when the probe is unavailable."""
    if not peer_site:
        raise LaunchError("peer_site", "required")
    try:
        split_host_port(address, "address")
    except ValueError as exc:
        raise LaunchError("address", str(exc).removeprefix("address: ")) from None
    if size < 0 or size > 1 << 30:
        raise LaunchError("bytes", "between 0 and 1 GiB")
    if rounds < 0 or rounds > 1000:
        raise LaunchError("rounds", "between 0 and 1000")
    try:
        module = importlib.import_module("grpc_kv.probe")
    except ImportError:
        raise LaunchError(
            "address", "grpc_kv.probe is not installed on this node", "FAILED_PRECONDITION"
        ) from None
    result: dict[str, Any] = await module.probe_for_agent(
        address=address,
        size=size or 8 << 20,
        rounds=rounds or 5,
        tls=None if config.insecure else config.tls,
    )
    return {
        "bandwidth_mbit_s": result["bandwidth_mbit_s"],
        "rtt_ms": result["rtt_ms"],
        "detail": f"peer {peer_site}",
    }
