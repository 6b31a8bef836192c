"""The engine test double (:mod:`tests.agents.gateway.engine_double`) as a process of its own,
so that a test can kill it: ``python -m tests.agents.gateway.engine_proc --name NAME
--kv-dir DIR [--port N] [--host H] [--prefill-delay-s S] [--fail-status N] [--journal FILE]`` prints
``{"port": N}`` once it listens and serves until SIGTERM (a slow or refusing engine with the
delay and status options; what it served in the journal).

Doubles of one test share the "KV" through files in ``--kv-dir`` (a prefill leg writes one
per transfer, a decode leg waits for it), so the remote path works across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from tests.agents.gateway.engine_double import EngineDouble, KvStore


class _FileEvent:
    """An ``asyncio.Event``-like flag that is a file (set: it exists)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def set(self) -> None:
        self.path.touch()

    def is_set(self) -> bool:
        return self.path.exists()

    async def wait(self) -> None:
        while not self.path.exists():
            await asyncio.sleep(0.005)


class FileKvStore(KvStore):
    """Transfers between double processes: one file per transfer id in ``root``."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def event(self, transfer_id: str) -> asyncio.Event:
        return _FileEvent(self.root / transfer_id)  # type: ignore[return-value]


async def _main(args: argparse.Namespace) -> None:
    double = EngineDouble(args.name, FileKvStore(Path(args.kv_dir)), args.kv_timeout_s)
    double.token_delay_s = args.token_delay_s
    double.prefill_delay_s = args.prefill_delay_s
    double.local_prefill_delay_s = args.local_prefill_delay_s
    double.fail_status = args.fail_status
    double.fail_code = args.fail_code
    double.journal = Path(args.journal) if args.journal else None
    double.max_prompt_chars = args.max_prompt_chars
    await double.start(port=args.port, host=args.host)
    port = int(double.url.rsplit(":", 1)[1])
    print(json.dumps({"port": port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await double.stop()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="engine_proc")
    p.add_argument("--name", default="engine")
    p.add_argument("--kv-dir", required=True)
    p.add_argument("--port", type=int, default=0)
    # Where it listens (0.0.0.0: also reachable from outside its network namespace).
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--kv-timeout-s", type=float, default=2.0)
    p.add_argument("--token-delay-s", type=float, default=0.0)
    # A slow prefill site: every prefill leg waits this long before its KV and its answer.
    p.add_argument("--prefill-delay-s", type=float, default=0.0)
    # A slow local prefill: a request without kv_transfer_params waits this long first.
    p.add_argument("--local-prefill-delay-s", type=float, default=0.0)
    # A refusing engine: every generation answered with this status (and error code).
    p.add_argument("--fail-status", type=int, default=None)
    p.add_argument("--fail-code", default=None)
    p.add_argument("--journal", default=None, help="JSON lines, one per generation request")
    # Longer prompts are refused as too long (400 context_length_exceeded).
    p.add_argument("--max-prompt-chars", type=int, default=30_000)
    asyncio.run(_main(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
