"""The engine's pool of grpc_kv links: one link per destination shared by transfers, retired
after its maximum age (new transfers get a fresh link, the old one closes with its last
transfer). Real receiver on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os

from grpc_kv.api import FingerprintMismatch, LinkOptions, LinkPool, TransferRefused, open_transfer
from tests.grpc_kv.kvtest import FP, INSECURE, OTHER_FP, make_header, receiver, run
from tests.support import connections_to


async def send(pool: LinkPool, server, target: str, link=None) -> None:
    link = link or pool.acquire(target)
    header = make_header({"kv": 256 << 10})
    consumer = asyncio.create_task(server.open(header.transfer_id, 10.0))
    try:
        async with open_transfer(target, header, pool.options, link=link) as tx:
            await tx.send_layer("kv", os.urandom(256 << 10))
            await tx.finish()
        async with await consumer as reader:
            assert sum([len(s.data) async for s in reader]) == 256 << 10
    finally:
        await pool.release(link)


def test_transfers_to_one_destination_share_one_link():
    async def scenario():
        async with receiver() as (server, target):
            pool = LinkPool(LinkOptions(connections=2, compression="none"), INSECURE)
            await asyncio.gather(*(send(pool, server, target) for _ in range(4)))
            await send(pool, server, target)
            port = int(target.rsplit(":", 1)[1])
            shared = pool.links, connections_to(port)
            await pool.close()
            await asyncio.sleep(0.2)
            return shared, pool.links, connections_to(port)

    (links, connections), links_after, connections_after = run(scenario())

    assert links == 1
    assert connections == 2
    assert (links_after, connections_after) == (0, 0)


def test_an_aged_link_is_retired_and_closes_with_its_last_transfer():
    async def scenario():
        async with receiver() as (server, target):
            pool = LinkPool(LinkOptions(connections=1, compression="none"), INSECURE, max_age_s=0)
            old = pool.acquire(target)
            await send(pool, server, target, link=pool.acquire(target))  # ages `old` out
            during = pool.links  # the retired link is still held by its user
            await pool.release(old)
            after = pool.links
            fresh = pool.acquire(target)
            await pool.release(fresh)
            await pool.close()
            return old is not fresh, during, after

    different, during, after = run(scenario())

    assert different
    assert during == 2
    assert after == 1


def test_a_link_whose_transfer_failed_is_retired_and_the_next_transfer_gets_a_new_one():
    """A failed transfer's connections may carry damage gRPC never notices (a corrupted byte in
    HTTP/2 header compression state): the engine hands the link back with ``failed=True``
    (GrpcSender on any failure but cancellation), and the next transfer to that destination
    connects afresh instead of reusing it for up to ``max_age_s``. Here the failure is a
    refused Begin (wrong model)."""

    async def scenario():
        async with receiver() as (server, target):
            pool = LinkPool(LinkOptions(connections=1, compression="none"), INSECURE)
            # A transfer that fails: the receiver is told to refuse it at Begin.
            bad = pool.acquire(target)
            header = make_header({"kv": 1024}, fingerprint=OTHER_FP)
            waiting = asyncio.create_task(
                server.open(header.transfer_id, 5.0, expect_fingerprint=FP)
            )
            await asyncio.sleep(0.05)  # the decode side registers its expectation first
            failed = False
            try:
                async with open_transfer(target, header, pool.options, link=bad) as tx:
                    await tx.send_layer("kv", os.urandom(1024))
                    await tx.finish()
            except TransferRefused:
                failed = True
            with contextlib.suppress(FingerprintMismatch):
                await waiting
            await pool.release(bad, failed=True)
            after_failure = pool.links
            await send(pool, server, target)  # the next transfer works, on a new link
            fresh = pool.acquire(target)
            await pool.release(fresh)
            await pool.close()
            return failed, after_failure, fresh is not bad

    failed, after_failure, fresh = run(scenario())

    assert failed
    assert after_failure == 0  # the failed link was closed (it had no other user)
    assert fresh
