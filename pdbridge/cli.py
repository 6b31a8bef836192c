"""The ``pdbridge`` operator CLI: a dispatcher that imports each subcommand lazily, so that
commands for agents and the KV link never import Django.

Each subsystem registers ``name: (module, function, help)``; the function takes the remaining
arguments (a list of strings) and returns an exit code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": (
        "pdbridge.run",
        "main",
        "the one-command testbed: local + remote site(s), a model deployed end to end (--console-only)",
    ),
    "soak": (
        "pdbridge.soak",
        "main",
        "the testbed under mixed load with a remote restart and a link cut; checks RSS/fds",
    ),
    "agent": (
        "agents.daemon",
        "main",
        "the node agent daemon: supervises engines, heartbeats, injects drill faults",
    ),
    "gateway": (
        "agents.gateway.cli",
        "main",
        "run the OpenAI-compatible gateway for a deployment (routing, fallback, breakers)",
    ),
    "serve": (
        "pdbridge.console_server",
        "main",
        "serve the console over HTTP(S) (hypercorn; deadlines for slow clients, --help for knobs)",
    ),
    "console": (
        "pdbridge.console_cli",
        "main",
        "Django management commands for the console (migrate, createsuperuser, ...)",
    ),
    "worker": (
        "pdbridge.celery_cli",
        "worker",
        "an orchestrator Celery worker (celery worker options follow)",
    ),
    "beat": (
        "pdbridge.celery_cli",
        "beat",
        "the orchestrator's periodic scheduler (celery beat options follow)",
    ),
    "engine": (
        "agents.engines.cli",
        "main",
        "reference engine: serve, build zoo weights; print vLLM command lines",
    ),
    "verify": (
        "agents.engines.verify",
        "main",
        "token-by-token verification of remote prefill + local decode against local runs",
    ),
    "loadgen": (
        "agents.loadgen",
        "main",
        "synthetic OpenAI-API load with a log-normal prompt-length mix (demos, drills)",
    ),
    "kv": (
        "grpc_kv.cli",
        "main",
        "the cross-datacenter KV link: serve, probe, loopback, certs, proxy",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: pdbridge COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in sorted(COMMANDS.items())]
    lines += ["", "pdbridge COMMAND --help shows a command's own options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from pdbridge import __version__

        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"pdbridge: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[name]
    function: Callable[[list[str]], int] = getattr(
        importlib.import_module(module_name), function_name
    )
    return int(function(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
