"""``pdbridge agent ctl``: an operator's command line for one agent's control API.

    pdbridge agent ctl --address 10.1.0.5:7070 --certs /etc/pdbridge/tls --name ops status
    pdbridge agent ctl ... launch prefill-engine --engine vllm --settings '{"model": "m"}'
    pdbridge agent ctl ... fault inject link_cut local --for 60
    pdbridge agent ctl ... logs prefill-engine --offset -4000

Prints the answer as JSON; an agent error prints ``CODE: message`` on stderr and exits 1,
bad arguments exit 2. Blocking (one call, with a deadline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from agents.client import AgentClient
from grpc_kv.tls import TLSConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdbridge agent ctl", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="agent host:port")
    p.add_argument("--certs", type=Path, help="directory written by `pdbridge kv certs`")
    p.add_argument("--name", help="the operator's certificate name inside --certs")
    p.add_argument("--server-name", help="name in the agent's certificate (when dialing an IP)")
    p.add_argument("--insecure", action="store_true", help="plaintext (loopback development)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status").add_argument("child", nargs="?", default="")
    launch = sub.add_parser("launch")
    launch.add_argument("kind")
    launch.add_argument("--engine", default="")
    launch.add_argument("--child-name", default="")
    launch.add_argument("--settings", default="{}", help="JSON object")
    launch.add_argument("--config-version", type=int, default=0)
    launch.add_argument("--deployment", type=int, default=0)
    for verb in ("stop", "restart"):
        sub.add_parser(verb).add_argument("child")
    logs = sub.add_parser("logs")
    logs.add_argument("child")
    logs.add_argument("--offset", type=int, default=-65536)
    logs.add_argument("--max-bytes", type=int, default=65536)
    fault = sub.add_parser("fault")
    fault_sub = fault.add_subparsers(dest="action", required=True)
    inject = fault_sub.add_parser("inject")
    inject.add_argument("kind")
    inject.add_argument("target")
    inject.add_argument(
        "--for", dest="duration_s", type=float, required=True, help="expiry, seconds"
    )
    inject.add_argument("--params", default="{}", help="JSON object")
    fault_sub.add_parser("clear").add_argument("id", nargs="?", default="")
    probe = sub.add_parser("probe")
    probe.add_argument("peer_site")
    probe.add_argument("peer_address")
    probe.add_argument("--seconds", type=float, default=3.0)
    sub.add_parser("metrics")
    return p


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"pdbridge agent ctl: {flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"pdbridge agent ctl: {flag}: a JSON object is required")
    return value


def _tls(args: argparse.Namespace) -> TLSConfig:
    if args.insecure:
        return TLSConfig.development()
    if args.certs is None or not args.name:
        raise SystemExit("pdbridge agent ctl: --certs DIR --name NAME required (or --insecure)")
    try:
        return TLSConfig.from_dir(args.certs, args.name, server_name=args.server_name)
    except ValueError as exc:
        raise SystemExit(f"pdbridge agent ctl: {exc}") from None


async def _call(args: argparse.Namespace) -> Any:
    deadline = {"timeout": args.timeout} if args.timeout else {}
    async with AgentClient(args.address, _tls(args)) as agent:
        command = args.command
        if command == "status":
            return await agent.status(args.child, **deadline)
        if command == "launch":
            settings = _json_object(args.settings, "--settings")
            return await agent.launch(
                args.kind,
                args.engine,
                settings,
                name=args.child_name,
                config_version=args.config_version,
                deployment_id=args.deployment,
                **deadline,
            )
        if command == "stop":
            return await agent.stop(args.child, **deadline)
        if command == "restart":
            return await agent.restart(args.child, **deadline)
        if command == "logs":
            return await agent.logs(args.child, args.offset, args.max_bytes, **deadline)
        if command == "fault" and args.action == "inject":
            params = _json_object(args.params, "--params")
            return await agent.inject_fault(
                args.kind, args.target, args.duration_s, params, **deadline
            )
        if command == "fault":
            return await agent.clear_fault(args.id, **deadline)
        if command == "probe":
            return await agent.probe(
                args.peer_site, args.peer_address, seconds=args.seconds, **deadline
            )
        return await agent.metrics(**deadline)


def main(argv: list[str]) -> int:
    """Entry point of ``pdbridge agent ctl`` (dispatched by :func:`agents.daemon.main`)."""
    args = _parser().parse_args(argv)
    try:
        answer = asyncio.run(_call(args))
    except grpc.aio.AioRpcError as exc:
        print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.command == "logs":
        sys.stdout.buffer.write(answer.data)
        return 0
    if args.command == "metrics":
        print(answer.agent, end="")
        return 0
    print(json.dumps(json_format.MessageToDict(answer, preserving_proto_field_name=True), indent=1))
    return 0
