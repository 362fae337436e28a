"""Read-ahead over a store 2 ms away (the project's proxy adding 1 ms each way): the
window grows past its sizes' rule to cover the distance, in the pipe and in the node,
and every value is right. No timing asserted: the speed is the bench's (``asynccache
bench --only latency``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import SequentialSampler
from torchdata.nodes import Loader, SamplerWrapper

import asynccache as ac
from asynccache.nodes import CachedMapper
from asynccache.testing.proxy import FaultProxy, url_through

N = 6000
SOURCE = [os.urandom(16) * 256 for _ in range(N)]  # 4 KiB each


@pytest.fixture(scope="module")
def far_url(redis_server: Any) -> Iterator[str]:
    """The test server 2 ms away, holding SOURCE under the namespace "far"."""
    pipe = ac.AsyncKVCacheMapDataPipe(SOURCE, ac.connect(redis_server.url), namespace="far")
    for start in range(0, N, 500):
        pipe.__getitems__(list(range(start, min(N, start + 500))))
        pipe.flush()
    pipe.close()
    with FaultProxy(redis_server.host, redis_server.port) as proxy:
        proxy.set_latency(0.002)
        yield url_through(proxy, redis_server.url)


def test_the_pipe_covers_the_distance(far_url: str) -> None:
    with ac.AsyncKVCacheMapDataPipe(SOURCE, ac.connect(far_url), namespace="far",
                                    prefetch=64) as dp:
        assert all(dp[i] == SOURCE[i] for i in range(N))
        prefetcher = dp._rt.local.prefetcher
        sizer = prefetcher.sizer
        assert sizer.extra > 0 and prefetcher.window > sizer._base[0]
        stats = dp.stats()
    assert stats["hits"] == N and stats["computed"] == 0


def test_the_node_covers_the_distance(far_url: str) -> None:
    node = CachedMapper(SamplerWrapper(SequentialSampler(range(N))), SOURCE.__getitem__,
                        ac.connect(far_url), namespace="far", prefetch=64)
    got = list(Loader(node))
    sizer = node._sizer
    stats = node.stats()
    node.close()
    assert got == SOURCE
    assert sizer.extra > 0 and sizer.window > sizer._base[0]
    assert stats["hits"] == N and stats["computed"] == 0
