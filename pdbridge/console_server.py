"""``pdbridge serve``: the console's HTTP(S) server, built to withstand slow clients.

Hypercorn (an asyncio HTTP/1.1 server) accepts every connection, does the TLS handshake and
reads the request headers in its event loop, under deadlines; the console's WSGI application
runs behind :class:`pdbridge.wsgi_bridge.BufferedWSGI`, which reads the request body and sends
the response from the event loop too, so the application's threads only ever run views. A
client that connects and says nothing, trickles its handshake, its headers or its body, or does
not read its response costs a socket and a little memory until its deadline, never a thread
(docs/console.md, "Serving": the choice, the figures, every knob).

The testbed (:mod:`pdbridge.testbed`), ``pdbridge run --console-only``, the systemd unit and the
Kubernetes manifest all start the console through this module; :func:`command` builds its
command line. Every knob is a :class:`ServerConfig` field documented once, set by a flag or by
the environment variable ``PDBRIDGE_CONSOLE_<FIELD>`` (flags win); ``--help`` lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdbridge.wsgi_bridge import BufferedWSGI, Receive, Scope, Send

ENV_PREFIX = "PDBRIDGE_CONSOLE_"


def _doc(text: str, **kwargs: Any) -> Any:
    return field(metadata={"doc": text}, **kwargs)


@dataclass
class ServerConfig:
    """How the console is served. Deadlines are in seconds."""

    bind: list[str] = _doc(
        "Addresses to listen on, ``host:port`` (several: repeat the flag, or commas in the "
        "variable); ``unix:/path`` for a Unix socket.",
        default_factory=lambda: ["127.0.0.1:8000"],
    )
    certfile: str = _doc("PEM certificate: serve HTTPS (with ``keyfile``); empty: plain HTTP.",
                         default="")  # fmt: skip
    keyfile: str = _doc("PEM private key of ``certfile``.", default="")
    workers: int = _doc(
        "Serving processes. 1 serves in this process; N > 1 forks N workers that share the "
        "sockets (a worker that dies stops the server: let systemd or Kubernetes restart it).",
        default=1,
    )
    threads: int = _doc(
        "Threads per process that run the console's views (only views: no client holds one).",
        default=8,
    )
    handshake_timeout: float = _doc(
        "TLS handshake deadline, from the TCP connect (a connection that sends nothing dies here).",
        default=10.0,
    )
    header_timeout: float = _doc(
        "Request-head deadline: from the handshake (or the previous response, the keep-alive "
        "idle time) to the end of the request headers.",
        default=10.0,
    )
    body_timeout: float = _doc(
        "Request-body deadline, from the end of the headers to the last body byte (else 408).",
        default=30.0,
    )
    send_timeout: float = _doc(
        "Response deadline: the client must take the whole response within it (else the "
        "connection is closed).",
        default=30.0,
    )
    max_body_bytes: int = _doc("Largest request body (else 413).", default=10 * 1024 * 1024)
    graceful_timeout: float = _doc(
        "On SIGTERM/SIGINT: how long requests in progress may finish.", default=10.0
    )
    backlog: int = _doc("Listen backlog (connections not yet accepted).", default=1024)
    access_log: bool = _doc("Log every request to stdout.", default=False)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ServerConfig:
        """Defaults overridden by ``PDBRIDGE_CONSOLE_<FIELD>`` variables (ValueError naming the
        variable on a bad value)."""
        environ = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name = ENV_PREFIX + f.name.upper()
            if name in environ:
                try:
                    values[f.name] = _parse(f, environ[name])
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        return cls(**values)

    def validate(self) -> None:
        """ValueError naming the knob when the configuration cannot serve."""
        if not self.bind:
            raise ValueError("bind: at least one address")
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("certfile/keyfile: give both (HTTPS) or neither (HTTP)")
        for name in ("workers", "threads", "max_body_bytes", "backlog"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: at least 1, got {getattr(self, name)}")
        for name in ("handshake_timeout", "header_timeout", "body_timeout", "send_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: a positive number of seconds, got {getattr(self, name)}")

    def environ(self) -> dict[str, str]:
        """This configuration as ``PDBRIDGE_CONSOLE_*`` variables (what worker processes read)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                text = ",".join(value)
            elif isinstance(value, bool):
                text = "true" if value else "false"
            else:
                text = str(value)
            out[ENV_PREFIX + f.name.upper()] = text
        return out

    def hypercorn(self) -> Any:
        """The hypercorn ``Config`` that serves :data:`application` this way."""
        from hypercorn.config import Config

        config = Config()
        config.application_path = "asgi:pdbridge.console_server:application"
        config.bind = list(self.bind)
        if self.certfile:
            config.certfile, config.keyfile = self.certfile, self.keyfile
        # HTTP/1.1 only: the deadlines above are h11's; the console needs nothing of HTTP/2.
        config.alpn_protocols = ["http/1.1"]
        config.workers = 0 if self.workers == 1 else self.workers
        config.ssl_handshake_timeout = self.handshake_timeout
        # Hypercorn's idle timer runs from the handshake (or the last response) until a
        # request's headers are complete: the head deadline and the keep-alive in one.
        config.keep_alive_timeout = self.header_timeout
        config.graceful_timeout = self.graceful_timeout
        config.backlog = self.backlog
        config.wsgi_max_body_size = self.max_body_bytes
        config.include_server_header = False
        # asyncio, not uvloop: uvloop served 20-70 % more requests a second here, but left TLS
        # connections cut at their deadline open for as long as its TLS shutdown waits (not
        # closed within 20 s of a 2 s head deadline; asyncio: within the deadline).
        config.worker_class = "asyncio"
        # Hypercorn's records go through the console's logging (settings.LOGGING) like the rest.
        config.accesslog = logging.getLogger("hypercorn.access") if self.access_log else None
        config.errorlog = logging.getLogger("hypercorn.error")
        return config


def _parse(f: dataclasses.Field[Any], text: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if kind.startswith("list"):
        return [part.strip() for part in text.split(",") if part.strip()]
    if kind == "bool":
        if text.strip().lower() not in {"1", "0", "true", "false", "yes", "no"}:
            raise ValueError(f"expected true or false, got {text!r}")
        return text.strip().lower() in {"1", "true", "yes"}
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    return text


def command(config: ServerConfig, python: str = sys.executable) -> list[str]:
    """The command line that serves the console with ``config`` (what the testbed runs)."""
    argv = [python, "-m", "pdbridge.cli", "serve"]
    defaults = ServerConfig()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "bind":
            argv += [a for address in value for a in ("--bind", address)]
        elif value != getattr(defaults, f.name):
            argv += (
                [flag]
                if value is True
                else ["--no-" + flag[2:]]
                if value is False
                else [flag, str(value)]
            )
    return argv


def testbed_config(binds: list[str], certfile: str | Path, keyfile: str | Path) -> ServerConfig:
    """How the testbed serves its console (:mod:`pdbridge.testbed`; the tests that stand for
    it start the console with this too): the defaults, HTTPS on ``binds`` (``host:port``)."""
    return ServerConfig(
        bind=list(binds), certfile=str(certfile), keyfile=str(keyfile), graceful_timeout=5.0
    )


def _parser(defaults: ServerConfig) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdbridge serve",
        description="Serve the console (HTTPS with --certfile/--keyfile). Each flag's default "
        f"comes from {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}THREADS), else the value shown.",
    )
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        doc = f.metadata["doc"].replace("%", "%%").replace("``", "")
        if f.name == "bind":
            parser.add_argument(flag, action="append", help=f"{doc} (default: {','.join(value)})")
        elif isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                                help=doc)  # fmt: skip
        else:
            parser.add_argument(flag, type=type(value), default=value,
                                help=f"{doc} (default: {value})")  # fmt: skip
    return parser


def main(argv: list[str]) -> int:
    """Entry point of ``pdbridge serve``: resolve the configuration, serve until a signal."""
    try:
        defaults = ServerConfig.from_env()
    except ValueError as exc:
        print(f"pdbridge serve: {exc}", file=sys.stderr)
        return 2
    args = _parser(defaults).parse_args(argv)
    values = {k: v for k, v in vars(args).items() if v is not None}
    config = dataclasses.replace(defaults, **values)
    try:
        config.validate()
    except ValueError as exc:
        print(f"pdbridge serve: {exc}", file=sys.stderr)
        return 2
    # Worker processes (and the application, built in each) read the same configuration.
    os.environ.update(config.environ())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    from hypercorn.run import run

    return run(config.hypercorn())


class _ConsoleApplication:
    """The console's WSGI application behind :class:`BufferedWSGI`, built at the first call
    (the server's lifespan start-up) in each serving process from ``PDBRIDGE_CONSOLE_*``."""

    def __init__(self) -> None:
        self._app: BufferedWSGI | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is None:
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
            from console.wsgi import application as wsgi

            config = ServerConfig.from_env()
            self._app = BufferedWSGI(
                wsgi,
                threads=config.threads,
                max_body_bytes=config.max_body_bytes,
                body_timeout_s=config.body_timeout,
                send_timeout_s=config.send_timeout,
            )
        await self._app(scope, receive, send)


#: What hypercorn serves (``asgi:pdbridge.console_server:application``).
application = _ConsoleApplication()
