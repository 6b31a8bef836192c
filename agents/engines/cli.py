"""``pdbridge engine ...``: serve the reference engine, build zoo weights, print the vLLM
command line.

Called by ``pdbridge.cli`` (lazy import, never Django). ``serve`` blocks until SIGTERM or
SIGINT, then stops gracefully; start-up failures (unknown model, weights hash mismatch,
missing TLS files) print one line naming the option and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import json
import logging
import os
import signal
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpc_kv.api import LinkPool

log = logging.getLogger("pdbridge.engines.cli")
MIB = 1 << 20


def _parse_model(spec: str, default_dtype: str) -> tuple[str, str, str]:
    """``[NAME=]SOURCE[@DTYPE]`` -> (name, source, dtype)."""
    name, _, rest = spec.rpartition("=")
    source, _, dtype = rest.partition("@")
    dtype = dtype or default_dtype
    return (name or Path(source).name), source, dtype


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.ssl_certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    if args.ssl_ca_certs:
        # mTLS: only clients holding a certificate from this CA may call the engine.
        ctx.load_verify_locations(args.ssl_ca_certs)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdbridge engine serve", description="Serve the reference engine."
    )
    p.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="[NAME=]SOURCE[@DTYPE]; SOURCE is a zoo architecture or a checkpoint directory (repeatable)",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--expect-sha256",
        action="append",
        default=[],
        help="[NAME=]SHA256 of the weights file; refuse to serve otherwise",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of generated zoo weights")
    p.add_argument("--models-dir", type=Path, default=None, help="where generated weights live")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = ephemeral; the chosen port is printed")
    p.add_argument("--chunked-prefill-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (same on both engines of a pair)"
    )
    p.add_argument(
        "--kv-spool", type=Path, default=None, help="receive remote KV from this spool directory"
    )
    p.add_argument(
        "--kv-listen",
        default=None,
        help="embed a grpc_kv receiver on HOST:PORT (decode role; port 0 = ephemeral)",
    )
    p.add_argument("--kv-tls-ca", help="CA of the KV link (mTLS)")
    p.add_argument("--kv-tls-cert", help="this node's KV link certificate")
    p.add_argument("--kv-tls-key", help="this node's KV link key")
    p.add_argument(
        "--kv-allowed-peer",
        action="append",
        default=None,
        help="certificate common name (identity) accepted on the KV link (repeatable; a SAN never"
        " matches)",
    )
    p.add_argument(
        "--kv-insecure", action="store_true", help="plaintext KV link (localhost development only)"
    )
    p.add_argument(
        "--kv-compression",
        default="auto",
        choices=("auto", "none", "zstd", "zstd-byteplane"),
        help="grpc_kv codec for sends",
    )
    p.add_argument(
        "--kv-connections",
        type=int,
        default=None,
        help="TCP connections per KV link (grpc_kv default)",
    )
    p.add_argument(
        "--kv-timeout-ms",
        type=int,
        default=None,
        help="deadline of each KV send, open to the receiver's confirmation (a deployment's "
        "kv_transfer.timeout_ms; grpc_kv default 4000)",
    )
    p.add_argument(
        "--kv-unreachable-ms",
        type=int,
        default=None,
        help="how long a send re-tries to open a transfer with a KV receiver it cannot reach "
        "before failing it as kv_unreachable (0: until the deadline; grpc_kv default 3000)",
    )
    p.add_argument(
        "--kv-retry",
        type=int,
        default=None,
        help="attempts per chunk after its first send (a deployment's kv_transfer.retry; "
        "grpc_kv default 3)",
    )
    p.add_argument(
        "--kv-chunk-size-mb",
        type=float,
        default=None,
        help="MiB per KV chunk (a deployment's kv_transfer.chunk_size_mb; grpc_kv default 4)",
    )
    p.add_argument(
        "--kv-checksum",
        default=None,
        choices=("xxh3", "crc32c", "none"),
        help="grpc_kv per-chunk checksum of sends (default xxh3; none with "
        "--no-verify-kv-digests). none is a diagnostic mode, never for production",
    )
    p.add_argument(
        "--no-verify-kv-digests",
        action="store_true",
        help="skip per-segment digests on the spool and per-chunk checksums on the grpc_kv "
        "link (a deployment's checksum=false; tests of the oracle)",
    )
    p.add_argument("--ssl-certfile")
    p.add_argument("--ssl-keyfile")
    p.add_argument("--ssl-ca-certs", help="require client certificates from this CA (mTLS)")
    p.add_argument(
        "--insecure", action="store_true", help="allow plaintext HTTP on a non-loopback address"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/ (as vLLM; default: $VLLM_API_KEY)",
    )
    p.add_argument("--api-key-file", type=Path, help="read the API key from this file")
    return p


def api_key(args: argparse.Namespace) -> str | None:
    """The engine's API key: ``--api-key``, else ``--api-key-file``, else ``VLLM_API_KEY``
    (None: no key, every request served). Raises ServeError naming the option."""
    if args.api_key and args.api_key_file:
        raise ServeError("--api-key and --api-key-file: choose one")
    key = args.api_key
    if args.api_key_file:
        try:
            key = args.api_key_file.read_text()
        except OSError as exc:
            raise ServeError(f"--api-key-file: {exc}") from exc
    if key is None:
        key = os.environ.get("VLLM_API_KEY") or None
    if key is not None and not key.strip():
        raise ServeError("--api-key: must not be empty")
    return key.strip() if key is not None else None


def link_options(args: argparse.Namespace) -> Any:
    """The grpc_kv ``LinkOptions`` of this engine's sends: the deployment's deadline, retries,
    chunk size and codec (``--kv-timeout-ms``, ``--kv-retry``, ``--kv-chunk-size-mb``,
    ``--kv-compression``; grpc_kv's defaults where absent). ``--no-verify-kv-digests`` (what a
    deployment's ``checksum=false`` becomes) also turns the link's per-chunk checksums off,
    so nothing on the path verifies the KV bytes. Raises ValueError naming the option."""
    from grpc_kv import api as kv

    checksum = args.kv_checksum or ("none" if args.no_verify_kv_digests else "xxh3")
    if args.no_verify_kv_digests and checksum != "none":
        raise ValueError(
            f"--kv-checksum: {checksum} contradicts --no-verify-kv-digests (which means none)"
        )
    link: dict[str, Any] = {
        "compression": kv.Codec(args.kv_compression),
        "checksum": kv.Checksum(checksum),
    }
    if args.kv_connections is not None:
        link["connections"] = args.kv_connections
    if args.kv_timeout_ms is not None:
        if args.kv_timeout_ms < 1:
            raise ValueError(f"--kv-timeout-ms: must be >= 1, got {args.kv_timeout_ms}")
        link["timeout_ms"] = args.kv_timeout_ms
    if args.kv_unreachable_ms is not None:
        if args.kv_unreachable_ms < 0:
            raise ValueError(f"--kv-unreachable-ms: must be >= 0, got {args.kv_unreachable_ms}")
        link["unreachable_ms"] = args.kv_unreachable_ms
    if args.kv_retry is not None:
        if args.kv_retry < 0:
            raise ValueError(f"--kv-retry: must be >= 0, got {args.kv_retry}")
        link["retry"] = args.kv_retry
    if args.kv_chunk_size_mb is not None:
        chunk = int(args.kv_chunk_size_mb * MIB)
        if chunk < 1:
            raise ValueError(f"--kv-chunk-size-mb: must be > 0, got {args.kv_chunk_size_mb}")
        link["chunk_size_bytes"] = chunk
    return kv.LinkOptions(**link)


class ServeError(Exception):
    """A start-up failure of the reference engine; the message names the option."""


def check_args(args: argparse.Namespace) -> None:
    """Refuse option combinations before anything loads (ServeError)."""
    if not args.ssl_certfile and not args.insecure and not _is_loopback(args.host):
        raise ServeError(
            "--host: plaintext on a non-loopback address needs --insecure (or --ssl-certfile)"
        )
    if args.chunked_prefill_tokens < 1 or args.max_num_seqs < 1 or args.threads < 1:
        raise ServeError("--chunked-prefill-tokens, --max-num-seqs, --threads: must be >= 1")
    api_key(args)


def load_models(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``--model``, loaded and hash-checked (blocking: seconds of CPU). Also pins torch's
    thread count, which is process-wide (``--threads``)."""
    from agents.engines.reference import zoo
    from agents.engines.reference.runner import set_threads

    set_threads(args.threads)
    zoo.quiet_transformers()
    expected: dict[str, str] = {}
    for item in args.expect_sha256:
        name, _, sha = item.rpartition("=")
        expected[name or "*"] = sha
    models: dict[str, zoo.LoadedModel] = {}
    try:
        for spec in args.model:
            name, source, dtype = _parse_model(spec, args.dtype)
            path = zoo.resolve_model(
                source, args.models_dir, args.seed if args.seed is not None else zoo.DEFAULT_SEED
            )
            models[name] = zoo.load_model(
                path, name=name, dtype=dtype, expect_sha256=expected.get(name, expected.get("*"))
            )
    except zoo.ModelError as exc:
        raise ServeError(f"pdbridge engine serve: {exc}") from exc
    return models


def ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The HTTP server's TLS context (None: plaintext); ServeError naming the options."""
    try:
        return _ssl_context(args)
    except (OSError, ssl.SSLError) as exc:
        raise ServeError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: {exc}") from exc


def serve(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        check_args(args)
        models = load_models(args)
        ctx = ssl_context(args)
    except ServeError as exc:
        print(exc, file=sys.stderr)
        return 2
    return asyncio.run(_run(args, models, ctx))


@dataclass
class Serving:
    """A started engine: its ready line (``port`` is the bound one) and what ``close`` stops."""

    ready: dict[str, Any]
    runner: Any
    links: LinkPool | None

    async def close(self) -> None:
        """Stop the HTTP site (in-flight requests end), then the KV links."""
        await self.runner.cleanup()
        if self.links is not None:
            await self.links.close()


async def start_serving(
    args: argparse.Namespace, models: dict[str, Any], ctx: ssl.SSLContext | None
) -> Serving:
    """Start the engine (HTTP site, KV receiver and link pool) in the running event loop and
    return at once: ``pdbridge engine serve`` and the reference adapter's in-process start
    share it. Raises ServeError naming the option."""
    from aiohttp import web

    from agents.engines.reference.server import EngineSettings, ReferenceEngine
    from agents.engines.reference.transport import (
        KvReceiver,
        SenderFactory,
        SpoolReceiver,
        open_spool_sender,
    )

    receiver: KvReceiver | None = None
    if args.kv_spool is not None:
        receiver = SpoolReceiver(args.kv_spool, verify_digests=not args.no_verify_kv_digests)
    open_sender: SenderFactory = open_spool_sender
    links: LinkPool | None = None
    kv_checksum: str | None = None  # the grpc_kv link's per-chunk checksum, when it is used
    kv_link: dict[str, int] | None = None  # the sends' deadline, retries and chunk size
    kv_tls_given = args.kv_insecure or args.kv_tls_cert
    if kv_tls_given or args.kv_listen:
        from agents.engines.reference.grpc_link import (
            GrpcReceiver,
            LinkPool,
            sender_factory,
            tls_from_args,
        )
        from grpc_kv import api as kv

        try:
            tls = tls_from_args(
                args.kv_tls_ca,
                args.kv_tls_cert,
                args.kv_tls_key,
                args.kv_insecure,
                args.kv_allowed_peer,
            )
            options = link_options(args)
            kv_checksum = options.checksum.value
            kv_link = {
                "timeout_ms": options.timeout_ms,
                "retry": options.retry,
                "chunk_size_bytes": options.chunk_size_bytes,
            }
        except ValueError as exc:
            raise ServeError(f"pdbridge engine serve: {exc}") from exc
        if args.kv_listen:
            if receiver is not None:
                raise ServeError("--kv-listen and --kv-spool: choose one receiver")
            try:
                # A decode engine told not to verify KV (the deployment's checksum: false)
                # accepts unverified transfers; any other refuses them.
                receiver = await GrpcReceiver.start(
                    args.kv_listen,
                    tls,
                    kv.ReceiverOptions(accept_unverified=options.checksum is kv.Checksum.NONE),
                )
            except (RuntimeError, ValueError, OSError) as exc:
                raise ServeError(f"--kv-listen: {exc}") from exc
        links = LinkPool(options, tls)
        open_sender = sender_factory(asyncio.get_running_loop(), links)
    settings = EngineSettings(
        role=args.role,
        chunked_prefill_tokens=args.chunked_prefill_tokens,
        max_num_seqs=args.max_num_seqs,
        threads=args.threads,
        api_key=api_key(args),
    )
    engine = ReferenceEngine(models, settings, receiver, open_sender)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, ssl_context=ctx)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        if links is not None:
            await links.close()
        raise ServeError(f"--host/--port: {exc}") from exc
    server = getattr(site, "_server", None)
    port = server.sockets[0].getsockname()[1] if server and server.sockets else args.port
    ready = {
        "event": "engine_ready",
        "host": args.host,
        "port": port,
        "role": args.role,
        "models": {n: m.fingerprint for n, m in models.items()},
        "kv_listen": getattr(receiver, "address", None),
        # "none" is the diagnostic mode (--no-verify-kv-digests): say so where operators look.
        "kv_checksum": kv_checksum,
        # What the deployment's kv_transfer settings became (None without a grpc_kv link).
        "kv_link": kv_link,
    }
    return Serving(ready, runner, links)


async def _run(args: argparse.Namespace, models: dict[str, Any], ctx: ssl.SSLContext | None) -> int:
    try:
        serving = await start_serving(args, models, ctx)
    except ServeError as exc:
        print(exc, file=sys.stderr)
        return 2
    # The models, modules and tensors loaded so far live as long as the process: kept out of
    # the collector, a full collection (grpc_kv runs one after a broken transfer to free its
    # connections) walks only the in-flight requests' objects instead of the whole heap.
    gc.collect()
    gc.freeze()
    print(json.dumps(serving.ready), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("engine_stopping", extra={"port": serving.ready["port"]})
    await serving.close()
    return 0


def build(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pdbridge engine build", description="Generate zoo weights; print their sha256."
    )
    p.add_argument("architecture", nargs="+")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--models-dir", type=Path, default=None)
    args = p.parse_args(argv)
    from agents.engines.reference import zoo

    zoo.quiet_transformers()
    out = {}
    try:
        for arch in args.architecture:
            path = zoo.resolve_model(
                arch, args.models_dir, args.seed if args.seed is not None else zoo.DEFAULT_SEED
            )
            out[arch] = {
                "path": str(path),
                "weights_sha256": zoo.file_sha256(path / zoo.WEIGHTS_FILE),
            }
    except zoo.ModelError as exc:
        print(f"pdbridge engine build: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


def vllm_command(argv: list[str]) -> int:
    from agents.engines.vllm import main as vllm_main

    return vllm_main(argv)


SUBCOMMANDS = {"serve": serve, "build": build, "vllm-command": vllm_command}


def main(argv: list[str]) -> int:
    """Entry point of ``pdbridge engine``."""
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in SUBCOMMANDS:
        print("usage: pdbridge engine {serve|build|vllm-command} [--help]")
        return 0 if not argv or argv[0] in {"-h", "--help"} else 2
    return SUBCOMMANDS[argv[0]](argv[1:])
