"""The engine's pool of grpc_kv links: one link per destination shared by transfers, retired
after its maximum age (new transfers get a fresh link, the old one closes with its last
transfer). Real receiver on loopback."""

from __future__ import annotations

import asyncio
import os

from agents.engines.reference.grpc_link import LinkPool
from grpc_kv.api import LinkOptions, open_transfer
from tests.grpc_kv.kvtest import INSECURE, make_header, receiver, run
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
