"""``pdbridge agent``: the node agent daemon.

Start-up order: load config (exit 2 naming the bad key), restore a previous agent's journalled
faults, reap its leftover child process groups, start the fault proxies, detect accelerators,
open the metrics endpoint and the control API (exit 1 naming the key it cannot use), write
``<state_dir>/agent.json`` (pid and bound ports, for supervisors and tests), then serve until
SIGTERM/SIGINT, which restores faults and stops children gracefully before exiting 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from datetime import UTC, datetime
from typing import Any

from agents.config import ConfigError, load_config, reference

log = logging.getLogger("pdbridge.agent")

_RESERVED = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event, plus the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _print_reference() -> None:
    print("| key | default | meaning |\n|---|---|---|")
    for key, default, doc in reference():
        print(f"| `{key}` | `{default}` | {doc} |")


async def serve(config_path: str | None) -> int:
    from agents.grpc_api import start_server
    from agents.service import AgentService, StartupError

    try:
        config = load_config(config_path)
        service = AgentService(config)  # reads console.token_file
    except ConfigError as exc:
        print(f"pdbridge agent: config error: {exc}", file=sys.stderr)
        return 2
    if config.insecure:
        log.warning(
            "agent.insecure", extra={"listen": config.listen, "detail": "plaintext, no allowlist"}
        )
    try:
        await service.start()
    except StartupError as exc:
        # Undo what did start (journalled faults restored, sessions closed) before exiting.
        await service.shutdown()
        print(f"pdbridge agent: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        server, port = await start_server(service)
        service.listening(port)  # heartbeats begin, saying where the control API listens
    except (RuntimeError, OSError) as exc:
        await service.shutdown()
        print(
            f"pdbridge agent: cannot start: listen: cannot listen on {config.listen}: {exc}",
            file=sys.stderr,
        )
        return 1
    info = {
        "pid": os.getpid(),
        "port": port,
        "metrics_port": service.metrics_port,
        "node": config.node.name,
    }
    info_path = service.state_dir / "agent.json"
    info_path.with_suffix(".tmp").write_text(json.dumps(info))
    os.replace(info_path.with_suffix(".tmp"), info_path)
    log.info("agent.started", extra=info)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("agent.stopping")
    await server.stop(grace=5)
    await service.shutdown()
    info_path.unlink(missing_ok=True)
    log.info("agent.stopped")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``pdbridge agent`` (registered in :mod:`pdbridge.cli`);
    ``pdbridge agent ctl ...`` is the operator's client (:mod:`agents.ctl`)."""
    if argv[:1] == ["ctl"]:
        from agents.ctl import main as ctl_main

        return ctl_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="pdbridge agent",
        description="Run the pdbridge node agent (`pdbridge agent ctl --help`: talk to one).",
    )
    parser.add_argument(
        "--config",
        help="agent.yaml (keys: see --config-reference); env PDBRIDGE_AGENT__* overrides",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve the control API without TLS (loopback development)",
    )
    parser.add_argument(
        "--config-reference", action="store_true", help="print every config key as a Markdown table"
    )
    parser.add_argument("--log-level", default=os.environ.get("PDBRIDGE_AGENT_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    if args.config_reference:
        _print_reference()
        return 0
    if args.insecure:
        os.environ["PDBRIDGE_AGENT__INSECURE"] = "true"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
    return asyncio.run(serve(args.config))
