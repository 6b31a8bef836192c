"""``Probe``: bandwidth and RTT to a peer site's kv-link receiver through grpc_kv's probe.

The measurement belongs to grpc_kv (:func:`grpc_kv.probe.probe`: a Ping for RTT, then bulk
1 MiB blocks over parallel streams, timed by the receiver); the agent validates the request
and dials with its own TLS material (the peer's receiver must allow this node's identity), and
reads its network namespace's TCP counters around it for the retransmitted share (the
link's loss as TCP saw it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from agents.config import ConfigError, split_host_port
from agents.launch import LaunchError
from grpc_kv.tls import TLSConfig

SNMP = Path("/proc/net/snmp")


def tcp_segments(snmp: Path = SNMP) -> tuple[int, int] | None:
    """(segments sent, segments retransmitted) of this network namespace so far, from the
    kernel's ``Tcp:`` counters; None where they cannot be read (not Linux)."""
    try:
        lines = [line.split() for line in snmp.read_text().splitlines() if line.startswith("Tcp:")]
        names, values = lines[0], lines[1]
        row = dict(zip(names[1:], (int(v) for v in values[1:]), strict=True))
        return row["OutSegs"], row["RetransSegs"]
    except (OSError, IndexError, KeyError, ValueError):
        return None


def retransmit_ratio(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """Retransmitted / sent segments between two readings; -1 when unknown (no reading, or
    nothing sent: a counter that went down or stood still)."""
    if before is None or after is None:
        return -1.0
    sent, again = after[0] - before[0], after[1] - before[1]
    if sent <= 0 or again < 0:
        return -1.0
    return round(again / sent, 6)


async def probe_peer(request: Any, tls: TLSConfig) -> dict[str, Any]:
    """Runs one probe (blocks the caller for about ``seconds``); returns the ProbeResponse
    fields. LaunchError naming the field on bad input; UNAVAILABLE when the peer is down."""
    from grpc_kv.probe import probe

    if not request.peer_site:
        raise LaunchError("peer_site", "required")
    try:
        split_host_port(request.address, "address")
    except ConfigError as exc:
        raise LaunchError("address", str(exc).removeprefix("address: ")) from None
    seconds = request.seconds or 3.0
    if not 0 < seconds <= 60:
        raise LaunchError("seconds", "between 0 and 60")
    if request.max_bytes < 0:
        raise LaunchError("max_bytes", "must not be negative")
    connections = request.connections or 2
    if not 1 <= connections <= 16:
        raise LaunchError("connections", "between 1 and 16")
    if request.server_name and not tls.insecure:
        tls = TLSConfig(
            ca_file=tls.ca_file,
            cert_file=tls.cert_file,
            key_file=tls.key_file,
            server_name=request.server_name,
        )
    elif not tls.insecure:
        tls = TLSConfig(ca_file=tls.ca_file, cert_file=tls.cert_file, key_file=tls.key_file)
    segments = tcp_segments()
    try:
        result = await probe(
            request.address,
            tls,
            seconds=seconds,
            max_bytes=request.max_bytes or None,
            connections=connections,
        )
    except grpc.aio.AioRpcError as exc:
        raise LaunchError(
            "address",
            f"peer {request.address} did not answer the probe: {exc.code().name} {exc.details()}",
            "UNAVAILABLE",
        ) from None
    return {
        "bandwidth_mbit_s": result["mbit_s"],
        "rtt_ms": result["rtt_ms"],
        "bytes": result["bytes"],
        "seconds": result["seconds"],
        "peer_site": request.peer_site,
        "tcp_retransmit_ratio": retransmit_ratio(segments, tcp_segments()),
    }
