"""Two processes of one machine share an LMDB near (a job's DataLoader workers, two jobs):
one writes or deletes a key while the other's far read of it is under way. The reader's
copy of the old value must never stay in near over the newer write or delete.

The two "processes" are two `Tiered` clients in one event loop: each keeps its own
record of writes (`_Copies`), exactly as two processes would, and share the LMDB files.
The reader reaches far through a proxy that delays each direction by 50 ms, so its read
is answered with the old value while the write happens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import asynccache as ac
from asynccache.testing.proxy import FaultProxy, url_through

pytestmark = pytest.mark.anyio

TRIALS = 6


@pytest.mark.parametrize("change", ["overwrite", "delete"])
async def test_a_copy_never_stays_over_another_process_write(
        redis_server: Any, tmp_path: Path, namespace: str, change: str) -> None:
    near_url = f"lmdb://{tmp_path}/near"
    with FaultProxy(redis_server.host, redis_server.port) as proxy:
        proxy.set_latency(0.1)
        reader = ac.AsyncKVCache(ac.Tiered(ac.connect(near_url),
                                           ac.connect(url_through(proxy, redis_server.url),
                                                      timeout=5)), namespace=namespace)
        writer = ac.AsyncKVCache(ac.Tiered(ac.connect(near_url),
                                           ac.connect(redis_server.url, timeout=5)),
                                 namespace=namespace)
        near_only = ac.connect(near_url)
        raced = 0
        async with reader, writer:
            for trial in range(TRIALS):
                key = f"k{trial}"
                await writer.set(key, "old")
                await near_only.delete_many([writer.keyspace.key(key)])  # far only
                read = asyncio.create_task(reader.get(key))
                await asyncio.sleep(0.075)  # the read is at far; its answer on the way
                if change == "overwrite":
                    await writer.set(key, "new")
                else:
                    await writer.delete(key)
                got = await read
                raced += got == "old"  # answered before the change: the race happened
                await asyncio.sleep(0.6)  # the copy and its check (a far round trip)
                expected = "new" if change == "overwrite" else None
                # near holds the newer value or nothing, never the old one
                assert await writer.get(key) == expected, f"trial {trial}"
                assert await reader.get(key) == expected, f"trial {trial}"
                held = (await near_only.get_many([writer.keyspace.key(key)]))[0]
                if held is not None:
                    assert writer.codec.decode(held, writer.keyspace.key(key)) == expected
            stats = reader.stats()
        await near_only.close()
    assert raced >= TRIALS // 2, f"the write came before the read in {TRIALS - raced} trials"
    assert stats["tier_copies_undone"] >= raced - 1, stats
