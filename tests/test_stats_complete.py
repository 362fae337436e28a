"""Stats are complete when the loop ends (issue 38, slice 3).

A DataLoader worker publishes its counters with the batch that ends its share of the
epoch (known when the pipe follows the loader's order), so right after ``for batch in
loader:`` the owner's ``stats()`` counts every read; without an order a worker publishes
at most PUBLISH_EVERY after its last batch. ``prefetch_hits`` counts only reads that
read-ahead served: not the misses it found.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch.utils.data import DataLoader

import asynccache as ac
from asynccache.readahead.runtime import PUBLISH_EVERY

N = 1_024
BATCH = 32


class Source:
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index


def reads(stats: dict[str, int]) -> int:
    return stats["hits"] + stats["misses"] + stats["recalled"]


@pytest.mark.parametrize("persistent", [False, True])
def test_every_read_is_counted_right_after_the_loop(redis_server: Any, namespace: str,
                                                    persistent: bool) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url),
                                    namespace=namespace)
    try:
        loader = DataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=2,
                            persistent_workers=persistent, collate_fn=len)
        dp.set_order(loader.batch_sampler)
        total = 0
        for epoch in range(3):
            total += sum(loader)
            stats = dp.stats()  # right away: no wait for a report
            assert reads(stats) == total, (epoch, stats)
            if epoch == 0:  # a cold epoch: every read a miss, none served by read-ahead
                assert stats["misses"] == N and stats["prefetch_hits"] == 0, stats
    finally:
        dp.close()


def test_without_an_order_every_read_is_counted_within_a_moment(redis_server: Any,
                                                                namespace: str) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url),
                                    namespace=namespace)
    try:
        loader = DataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=2,
                            persistent_workers=True, collate_fn=len)
        total = 0
        for _ in range(2):
            total += sum(loader)
            # the bound is the scale of the defect (a whole epoch behind, seconds), with
            # room for a busy machine; the design's lag is PUBLISH_EVERY
            deadline = time.monotonic() + 20 * PUBLISH_EVERY + 2
            while reads(stats := dp.stats()) < total and time.monotonic() < deadline:
                time.sleep(0.01)
            assert reads(stats) == total, stats
    finally:
        dp.close()
