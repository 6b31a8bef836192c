"""``pdbridge gateway``: run the OpenAI-compatible gateway for one deployment.

Either ``--deployment ID --console URL`` (poll the console's config snapshot; the token comes
from ``--token`` or ``PDBRIDGE_GATEWAY_TOKEN``) or ``--config FILE`` (a static snapshot, as
the console would serve it). Knobs: ``--settings FILE`` (YAML, see docs/gateway.md).
TLS by default: serving needs ``--tls-cert/--tls-key`` and an ``https://`` console URL, unless
``--insecure`` is given explicitly. Client API keys and the engines' key come from the
environment (``agents.gateway.access``). Never imports Django.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import ssl
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from agents.gateway import logs
from agents.gateway.config import ConfigError, load_settings, load_snapshot_file


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdbridge gateway", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--deployment", type=int, help="deployment id to poll from the console")
    source.add_argument("--config", type=Path, help="static config snapshot file (JSON/YAML)")
    p.add_argument("--console", help="console base URL (with --deployment)")
    p.add_argument(
        "--token", default=os.environ.get("PDBRIDGE_GATEWAY_TOKEN"), help="node or user token"
    )
    p.add_argument("--settings", type=Path, help="gateway settings YAML")
    p.add_argument("--host", help="listen address (overrides settings)")
    p.add_argument("--port", type=int, help="listen port, 0 for ephemeral (overrides settings)")
    p.add_argument("--state-dir", help="where the last good config is kept (overrides settings)")
    p.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    p.add_argument("--tls-key", type=Path, help="server key (PEM)")
    p.add_argument("--ca-file", type=Path, help="CA bundle for the console and https engines")
    p.add_argument("--client-cert", type=Path, help="client certificate for mTLS upstream")
    p.add_argument("--client-key", type=Path, help="client key for mTLS upstream")
    p.add_argument("--insecure", action="store_true", help="allow plaintext (tests, loopback)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str]) -> int:
    """Entry point registered in ``pdbridge.cli``; returns an exit code."""
    args = _parser().parse_args(argv)
    try:
        settings = load_settings(args.settings)
    except (ConfigError, OSError) as error:
        print(f"pdbridge gateway: {error}", file=sys.stderr)
        return 2
    overrides = {
        k: v
        for k, v in {"host": args.host, "port": args.port, "state_dir": args.state_dir}.items()
        if v is not None
    }
    settings = dataclasses.replace(settings, **overrides)
    if args.deployment is not None and not args.console:
        print("pdbridge gateway: --console URL is required with --deployment", file=sys.stderr)
        return 2
    if not args.insecure:
        if not (args.tls_cert and args.tls_key):
            print(
                "pdbridge gateway: --tls-cert/--tls-key required (or --insecure)", file=sys.stderr
            )
            return 2
        if args.console and not args.console.startswith("https://"):
            print(
                "pdbridge gateway: the console URL must be https:// (or --insecure)",
                file=sys.stderr,
            )
            return 2
    ssl_server = None
    if args.tls_cert and args.tls_key:
        ssl_server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_server.load_cert_chain(args.tls_cert, args.tls_key)
    ssl_client = None
    if args.ca_file or args.client_cert:
        ssl_client = ssl.create_default_context(cafile=str(args.ca_file) if args.ca_file else None)
        if args.client_cert and args.client_key:
            ssl_client.load_cert_chain(args.client_cert, args.client_key)
    logs.configure(args.log_level)
    try:
        factory = loop_factory(settings.event_loop)
    except ConfigError as error:
        print(f"pdbridge gateway: {error}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_run(args, settings, ssl_server, ssl_client))


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event-loop factory for ``settings.event_loop`` (None: asyncio's default loop).
    ``auto`` takes uvloop when it is installed (an optional dependency) and asyncio's loop
    otherwise; ``uvloop`` without uvloop installed raises :class:`ConfigError`."""
    if name == "asyncio":
        return None
    try:
        import uvloop  # optional dependency, imported only when asked for
    except ImportError as error:
        if name == "uvloop":
            raise ConfigError("settings.event_loop: uvloop is not installed") from error
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def _run(
    args: argparse.Namespace,
    settings: object,
    ssl_server: ssl.SSLContext | None,
    ssl_client: ssl.SSLContext | None,
) -> int:
    # Imported here: aiohttp's server stack is only needed once arguments are valid.
    from agents.gateway.access import AccessPoller, ClientKeys, engine_api_key
    from agents.gateway.app import Gateway
    from agents.gateway.config import GatewaySettings
    from agents.gateway.poller import ConfigPoller
    from agents.gateway.server import serve_forever
    from agents.gateway.traceship import TraceShipper

    assert isinstance(settings, GatewaySettings)  # noqa: S101 - narrowing for mypy
    try:
        # Secrets from the environment or files it names, never from the settings file.
        keys = ClientKeys.from_environ(os.environ, require=settings.require_client_keys)
        engine_key = engine_api_key(os.environ)
        debug_token = debug_token_from(os.environ)
    except ConfigError as error:
        print(f"pdbridge gateway: {error}", file=sys.stderr)
        return 2
    gateway = Gateway(
        settings,
        upstream_ssl=ssl_client,
        keys=keys,
        engine_api_key=engine_key,
        debug_token=debug_token,
    )
    poller = access = shipper = None
    if args.config is not None:
        try:
            gateway.apply(load_snapshot_file(args.config))
        except (ConfigError, OSError, ValueError) as error:
            print(f"pdbridge gateway: {args.config}: {error}", file=sys.stderr)
            return 2
    else:
        poller = ConfigPoller(
            console_url=args.console,
            deployment_id=args.deployment,
            token=args.token,
            interval_s=settings.poll_interval_s,
            state_dir=Path(settings.state_dir),
            apply=gateway.apply,
            on_result=lambda result: gateway.metrics.config_polls.labels(result).inc(),
            ssl_context=ssl_client,
        )
        access = AccessPoller(
            console_url=args.console,
            deployment_id=args.deployment,
            token=args.token,
            interval_s=settings.poll_interval_s,
            state_dir=Path(settings.state_dir),
            keys=keys,
            ssl_context=ssl_client,
        )
        if settings.trace_ring_size > 0 and settings.trace_ship_queue > 0:
            gateway.traces.ship_queue = settings.trace_ship_queue
            gateway.traces.sample_rate = settings.trace_ship_sample_rate
            shipper = TraceShipper(
                ring=gateway.traces,
                console_url=args.console,
                token=args.token,
                interval_s=settings.trace_ship_interval_s,
                ssl_context=ssl_client,
            )
    await serve_forever(
        gateway, poller=poller, ssl_server=ssl_server, access=access, shipper=shipper
    )
    return 0


def debug_token_from(environ: Mapping[str, str]) -> str | None:
    """The bearer token of ``/debug/traces``: ``PDBRIDGE_GATEWAY_DEBUG_TOKEN`` or the file
    ``PDBRIDGE_GATEWAY_DEBUG_TOKEN_FILE`` names (not both; None: the endpoint refuses every
    caller). Raises ConfigError naming the variable."""
    value = environ.get("PDBRIDGE_GATEWAY_DEBUG_TOKEN")
    path = environ.get("PDBRIDGE_GATEWAY_DEBUG_TOKEN_FILE")
    if value and path:
        raise ConfigError(
            "PDBRIDGE_GATEWAY_DEBUG_TOKEN, PDBRIDGE_GATEWAY_DEBUG_TOKEN_FILE: set one, not both"
        )
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as error:
            raise ConfigError(f"PDBRIDGE_GATEWAY_DEBUG_TOKEN_FILE: {error}") from error
        if not value:
            raise ConfigError("PDBRIDGE_GATEWAY_DEBUG_TOKEN_FILE: the file is empty")
    return value.strip() if value else None
