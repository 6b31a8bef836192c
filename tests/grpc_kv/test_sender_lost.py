"""A sender that dies mid-transfer is noticed by the receiver in seconds, not at its consumer's
deadline: a real sender process (kill -9 after Begin and part of a layer) leaves the consumer
with SenderLost naming the node well before the deadline, on both data paths; a live sender
that sends nothing for longer than the bound (a long prefill step) keeps its transfer."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from grpc_kv.api import LinkOptions, ReceiverOptions, SenderLost, open_transfer
from tests.grpc_kv.kvtest import FP, INSECURE, make_header, receiver, run
from tests.support import subprocess_env

LOST_S = 1.0
DEADLINE_S = 60.0

SENDER = """
import asyncio, sys
from grpc_kv.api import Fingerprint, LayerSpec, LinkOptions, TLSConfig, TransferHeader
from grpc_kv.api import open_transfer

async def main(target, tid, data_path):
    header = TransferHeader(transfer_id=tid, fingerprint=Fingerprint("a" * 64, "arch-1"),
                            layers=(LayerSpec("l0", length=2 << 20),))
    options = LinkOptions(timeout_ms=120000, chunk_size_bytes=256 << 10, data_path=data_path)
    async with open_transfer(target, header, options, TLSConfig.development()) as tx:
        await tx.send_layer("l0", bytes(1 << 20), final=False)
        print("sent", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


async def _drain(reader: Any) -> None:
    async with reader:
        async for _segment in reader:
            pass


@pytest.mark.parametrize("data_path", ["grpc", "bulk"])
def test_a_killed_sender_fails_its_transfer_in_seconds_naming_the_cause(data_path: str) -> None:
    async def scenario() -> None:
        options = ReceiverOptions(sender_lost_s=LOST_S, ttl_s=DEADLINE_S, bulk=True)
        async with receiver(options) as (server, target):
            tid = make_header().transfer_id
            proc = subprocess.Popen(
                [sys.executable, "-c", SENDER, target, tid, data_path],
                env=subprocess_env(),
                stdout=subprocess.PIPE,
            )
            try:
                assert proc.stdout is not None
                line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
                assert line.strip() == b"sent", line
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            killed = time.monotonic()
            reader = await server.open(tid, DEADLINE_S, expect_fingerprint=FP)
            with pytest.raises(SenderLost, match="sender lost: no data connection from"):
                await _drain(reader)
            # Seconds, not the consumer's deadline (the bound is LOST_S; generous for a
            # busy machine, far from DEADLINE_S).
            assert time.monotonic() - killed < DEADLINE_S / 4

    run(scenario(), timeout=DEADLINE_S * 2)


def test_a_live_sender_quiet_for_longer_than_the_bound_keeps_its_transfer() -> None:
    async def scenario() -> None:
        options = ReceiverOptions(sender_lost_s=LOST_S, ttl_s=DEADLINE_S)
        async with receiver(options) as (server, target):
            header = make_header({"l0": 2 << 20})
            link = LinkOptions(timeout_ms=int(DEADLINE_S * 1000), chunk_size_bytes=256 << 10)

            async def send() -> None:
                async with open_transfer(target, header, link, INSECURE) as tx:
                    await tx.send_layer("l0", bytes(1 << 20), final=False)
                    await asyncio.sleep(LOST_S * 3)  # a long prefill step: streams stay open
                    await tx.send_layer("l0", bytes(1 << 20), final=True)
                    await tx.finish()

            sending = asyncio.ensure_future(send())
            got = 0
            async with await server.open(header.transfer_id, DEADLINE_S, FP) as reader:
                async for segment in reader:
                    got += len(segment.data)
            await sending
            assert got == 2 << 20

    run(scenario(), timeout=DEADLINE_S * 2)
