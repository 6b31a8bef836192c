"""A tiny blocking HTTP client for the engine tests (urllib: no extra dependency)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

# Tests only call loopback http:// URLs they built themselves.


def post(url: str, body: Any, timeout: float = 120.0) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})  # noqa: S310
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"null")


def get(url: str, timeout: float = 30.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310
        return resp.status, resp.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Value of one Prometheus sample (0.0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                return float(value)
    return 0.0


def prefill_leg(
    base: str, body: dict[str, Any], transfer_id: str, destination: str
) -> tuple[int, dict[str, str], Any]:
    """POST the prefill leg of a disaggregated request (vLLM's ``do_remote_decode``)."""
    kv = {"do_remote_decode": True, "transfer_id": transfer_id, "kv_destination": destination}
    return post(f"{base}/v1/completions", {**body, "kv_transfer_params": kv})


def decode_leg(
    base: str, body: dict[str, Any], transfer_id: str, deadline_s: float = 30, **kv: Any
) -> tuple[int, dict[str, str], Any]:
    """POST the decode leg (``do_remote_prefill``); extra ``kv`` fields such as ``fallback``."""
    params = {"do_remote_prefill": True, "transfer_id": transfer_id, "deadline_s": deadline_s, **kv}
    return post(f"{base}/v1/completions", {**body, "kv_transfer_params": params})


def free_port() -> int:
    """An unused ephemeral loopback port (probed; bound again by the caller)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
