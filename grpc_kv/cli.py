"""``pdbridge kv``: serve | probe | loopback | certs | proxy.

Never imports Django. Every command returns an exit code: 0 ok, 1 the operation failed
(unreachable, refused, verification failed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from grpc_kv.options import MIB, LinkOptions, ReceiverOptions
from grpc_kv.tls import TLSConfig


def _tls_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("transport security (mTLS unless --insecure)")
    group.add_argument("--certs", type=Path, help="directory written by `pdbridge kv certs`")
    group.add_argument("--name", help="this node's certificate name inside --certs")
    group.add_argument("--ca", type=Path, help="CA certificate (instead of --certs)")
    group.add_argument("--cert", type=Path, help="this node's certificate")
    group.add_argument("--key", type=Path, help="this node's private key")
    group.add_argument(
        "--allow-peer",
        action="append",
        default=None,
        help="accept only peers whose certificate's common name is exactly this (repeatable;"
        " subject alternative names never match)",
    )
    group.add_argument("--server-name", help="name expected in the server's certificate")
    group.add_argument(
        "--insecure", action="store_true", help="plaintext, for localhost development only"
    )


def _tls(args: argparse.Namespace) -> TLSConfig:
    if args.insecure:
        return TLSConfig(insecure=True)
    if args.certs is not None:
        if not args.name:
            raise ValueError("--name: required with --certs")
        return TLSConfig.from_dir(
            args.certs, args.name, allowed_peers=args.allow_peer, server_name=args.server_name
        )
    if args.ca or args.cert or args.key:
        return TLSConfig(
            ca_file=args.ca,
            cert_file=args.cert,
            key_file=args.key,
            allowed_peers=args.allow_peer,
            server_name=args.server_name,
        )
    raise ValueError("tls: pass --certs DIR --name NODE (or --insecure for localhost development)")


def _print(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    print(json.dumps(result, sort_keys=True) if args.json else text, flush=True)


async def _serve(args: argparse.Namespace) -> int:
    from grpc_kv.receiver import ReceiverServer

    options = ReceiverOptions(
        memory_budget_bytes=int(args.memory_budget_mb * MIB),
        max_chunk_bytes=int(args.max_chunk_mb * MIB),
        ttl_s=args.ttl_s,
        accept_unverified=args.accept_unverified,
        bulk=args.bulk,
        bulk_port=args.bulk_port,
    )
    server = ReceiverServer(
        args.bind,
        options,
        _tls(args),
        local_socket=args.local_socket,
        local_socket_mode=args.local_socket_mode,
    )
    port = await server.start()
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr="127.0.0.1", registry=server.metrics.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bulk_port = server.bulk.port if server.bulk else None
    print(json.dumps({"event": "kv_serve_ready", "port": port, "bulk_port": bulk_port}), flush=True)
    await stop.wait()
    await server.stop(args.grace_s)
    return 0


async def _probe(args: argparse.Namespace) -> int:
    from grpc_kv.probe import probe

    result = await probe(
        args.to,
        _tls(args),
        seconds=args.seconds,
        max_bytes=args.bytes,
        connections=args.connections,
    )
    _print(
        args, result, f"{result['mbit_s']:.1f} Mbit/s, rtt {result['rtt_ms']:.2f} ms to {args.to}"
    )
    return 0


async def _loopback(args: argparse.Namespace) -> int:
    from grpc_kv.probe import loopback

    options = LinkOptions(
        chunk_size_bytes=int(args.chunk_mb * MIB),
        compression=args.compression,
        connections=args.connections,
        timeout_ms=args.timeout_ms,
        unreachable_ms=args.unreachable_ms,
        data_path=args.data_path,
    )
    result = await loopback(
        args.to,
        _tls(args),
        blocks=args.blocks,
        block_bytes=int(args.block_mb * MIB),
        options=options,
    )
    text = (
        f"loopback ok: {result['blocks']} blocks, {result['bytes_raw']} bytes verified, "
        f"{result['mbit_s']:.1f} Mbit/s, retransmits {result['retransmits']}"
        if result["ok"]
        else f"loopback FAILED: {result['error']}"
    )
    _print(args, result, text)
    return 0 if result["ok"] else 1


def _certs(args: argparse.Namespace) -> int:
    from grpc_kv.certs import CertFiles, create_ca, create_node_cert

    out: Path = args.out
    if args.san and len(args.node) > 1:
        # Extra names belong to one node: given to several, any of them would answer to all.
        raise ValueError(
            "--san: names the extra DNS names/IPs of one node; issue one --node per run "
            f"when it has --san (got {len(args.node)} nodes)"
        )
    if (out / "ca.pem").exists() and (out / "ca-key.pem").exists():
        ca = CertFiles(out / "ca.pem", out / "ca.pem", out / "ca-key.pem")
    else:
        ca = create_ca(out, args.ca_name)
        print(f"created CA {ca.ca_file}")
    for node in args.node:
        files = create_node_cert(ca, out, node, sans=args.san, loopback=args.loopback)
        print(f"issued {files.cert_file} and {files.key_file}")
    return 0


async def _proxy(args: argparse.Namespace) -> int:
    from grpc_kv.faultproxy import Bandwidth, FaultProxy, Flip, Latency

    proxy = FaultProxy(args.upstream, args.listen)
    if args.latency_ms:
        proxy.add(Latency(ms=args.latency_ms, jitter_ms=args.jitter_ms))
    if args.bandwidth_mbit:
        proxy.add(Bandwidth(bytes_per_s=args.bandwidth_mbit * 1e6 / 8))
    if args.flip_offset:
        proxy.add(Flip(direction="upstream", offsets=tuple(args.flip_offset)))
    port = await proxy.start()
    print(json.dumps({"event": "kv_proxy_ready", "port": port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.stop()
    return 0


def _octal_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 600") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r}: permissions are 000..777")
    return mode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdbridge kv", description="the cross-DC KV link")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a receiver sidecar")
    serve.add_argument("--bind", default="0.0.0.0:7070", help="host:port (port 0 = ephemeral)")
    serve.add_argument("--local-socket", type=Path, help="also serve consumers on this Unix socket")
    serve.add_argument(
        "--local-socket-mode",
        type=_octal_mode,
        default=0o600,
        help="permissions of --local-socket, octal (default 600: only this user's engines;"
        " 660 lets the socket's group in)",
    )
    serve.add_argument("--metrics-port", type=int, help="Prometheus metrics on 127.0.0.1:PORT")
    serve.add_argument("--memory-budget-mb", type=float, default=1024)
    serve.add_argument("--max-chunk-mb", type=float, default=64)
    serve.add_argument("--ttl-s", type=float, default=30.0)
    serve.add_argument(
        "--accept-unverified",
        action="store_true",
        help="accept transfers sent with checksum none (diagnostics; refused by default)",
    )
    serve.add_argument("--grace-s", type=float, default=2.0)
    serve.add_argument(
        "--bulk-port",
        type=int,
        default=0,
        help="port of the bulk data endpoint on the --bind host (0 = ephemeral)",
    )
    serve.add_argument(
        "--bulk", action="store_true", help="offer the bulk data path (a second listening port)"
    )
    _tls_args(serve)

    probe = sub.add_parser("probe", help="bandwidth (Mbit/s) and RTT to a receiver")
    probe.add_argument("--to", required=True, help="receiver host:port")
    probe.add_argument("--seconds", type=float, default=3.0)
    probe.add_argument("--bytes", type=int, help="stop after this many bytes")
    probe.add_argument("--connections", type=int, default=2)
    probe.add_argument("--json", action="store_true")
    _tls_args(probe)

    loop = sub.add_parser("loopback", help="send verified test blocks (deployment step 5)")
    loop.add_argument("--to", help="receiver host:port (default: an in-process receiver)")
    loop.add_argument("--blocks", type=int, default=16)
    loop.add_argument("--block-mb", type=float, default=4)
    loop.add_argument("--chunk-mb", type=float, default=4)
    loop.add_argument("--compression", default="auto")
    loop.add_argument("--connections", type=int, default=2)
    loop.add_argument("--timeout-ms", type=int, default=60_000)
    loop.add_argument(
        "--unreachable-ms",
        type=int,
        default=LinkOptions.unreachable_ms,
        help="fail after this long without an answer from the receiver (0: until the deadline)",
    )
    loop.add_argument(
        "--data-path",
        choices=("grpc", "bulk"),
        default="grpc",
        help="chunks over gRPC streams or the bulk data connections",
    )
    loop.add_argument("--json", action="store_true")
    _tls_args(loop)

    certs = sub.add_parser("certs", help="create a CA (if missing) and node certificates")
    certs.add_argument("--out", type=Path, required=True)
    certs.add_argument(
        "--node",
        action="append",
        default=[],
        help="node name: the certificate's common name, its identity (repeatable)",
    )
    certs.add_argument(
        "--san",
        action="append",
        default=[],
        help="another DNS name or IP of the node (repeatable; with one --node only)",
    )
    certs.add_argument(
        "--loopback",
        action="store_true",
        help="also name localhost and 127.0.0.1 (single-machine development only)",
    )
    certs.add_argument("--ca-name", default="pdbridge-ca")

    proxy = sub.add_parser("proxy", help="a TCP fault proxy (latency, bandwidth, flips)")
    proxy.add_argument("--upstream", required=True, help="host:port to forward to")
    proxy.add_argument("--listen", default="127.0.0.1:0")
    proxy.add_argument("--latency-ms", type=float, default=0.0)
    proxy.add_argument("--jitter-ms", type=float, default=0.0)
    proxy.add_argument("--bandwidth-mbit", type=float, default=0.0)
    proxy.add_argument("--flip-offset", type=int, action="append", default=[])
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        if args.command == "certs":
            return _certs(args)
        runner = {"serve": _serve, "probe": _probe, "loopback": _loopback, "proxy": _proxy}
        return asyncio.run(runner[args.command](args))
    except ValueError as exc:
        print(f"pdbridge kv {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"pdbridge kv {args.command}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            print("interrupted", file=sys.stderr)
        return 130
