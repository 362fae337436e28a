"""Stats are complete when the loop ends (issue 38, slice 3).

A DataLoader worker publishes its counters before it hands each batch over, so once the
loop has received a batch the owner's ``stats()`` counts its reads: mid-epoch, right after
``for batch in loader:``, with an order or without. ``prefetch_hits`` counts only reads that
read-ahead served: not the misses it found.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader

import asynccache as ac

N = 1_024
BATCH = 32


class Source:
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index


def reads(stats: dict[str, int]) -> int:
    return stats["hits"] + stats["misses"] + stats["recalled"]


def loop_counting(loader: DataLoader[Any], dp: ac.AsyncKVCacheMapDataPipe) -> int:
    """Iterate over one epoch; after each batch the loop has received, the pipe's stats
    count at least the reads of the batches received so far (workers may be ahead)."""
    received = 0
    for size in loader:
        received += size
        assert reads(dp.stats()) >= received, (dp.stats(per_process=True), dp._reports.board.errors)
    return received


@pytest.mark.parametrize("ordered", [True, False], ids=["set_order", "no_order"])
@pytest.mark.parametrize("persistent", [False, True])
def test_every_read_is_counted_by_the_time_the_loop_has_its_batch(
        redis_server: Any, namespace: str, persistent: bool, ordered: bool) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url),
                                    namespace=namespace)
    try:
        loader = DataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=2,
                            persistent_workers=persistent, collate_fn=len)
        if ordered:
            dp.set_order(loader.batch_sampler)
        total = 0
        for epoch in range(3):
            total += loop_counting(loader, dp)
            stats = dp.stats()  # right away: no wait for a report
            assert reads(stats) == total, (epoch, stats)
            if epoch == 0:  # a cold epoch: every read a miss, none served by read-ahead
                assert stats["misses"] == N and stats["prefetch_hits"] == 0, stats
            assert stats["hit_rate"] == stats["hits"] / total  # over the same sum
            per_process = dp.stats(per_process=True)
            assert all(0.0 <= one["hit_rate"] <= 1.0 for one in per_process.values())
    finally:
        dp.close()


def test_the_cache_and_the_node_have_a_hit_rate_too(redis_server: Any, namespace: str) -> None:
    import asyncio

    from torchdata.nodes import Loader, SamplerWrapper

    from asynccache.nodes import CachedMapper

    async def run() -> dict[str, Any]:
        async with ac.AsyncKVCache(ac.connect(redis_server.url), namespace=namespace) as cache:
            assert cache.stats()["hit_rate"] == 0.0  # no read yet
            await cache.set_many({i: i for i in range(3)})
            await cache.get_many(list(range(4)))  # 3 hits, 1 miss
            return cache.stats()

    stats = asyncio.run(run())
    assert stats["hit_rate"] == 0.75 and type(stats["hits"]) is int
    node = CachedMapper(SamplerWrapper(range(8)), int, ac.connect(redis_server.url),
                        namespace=namespace + "-node")
    assert list(Loader(node)) == list(range(8))
    assert node.stats()["hit_rate"] == 0.0 and node.stats()["misses"] == 8
