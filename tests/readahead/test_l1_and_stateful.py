"""The L1 tier, and resuming under torchdata's StatefulDataLoader (pipe and node)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler
from torchdata.nodes import SamplerWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

import asynccache as ac
from asynccache.nodes import CachedMapper, NodeIterable
from conftest import computed, record_computation

N = 96
BATCH = 8


class Recorded(torch.utils.data.Dataset):
    def __init__(self, n: int, log: str, size: int = 64) -> None:
        self.n, self.log, self.size = n, log, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        record_computation(self.log, index)
        return {"i": index, "t": torch.full((self.size,), float(index))}



def listed(batch: list[Any]) -> list[Any]:
    return batch


# ------------------------------------------------------------------------------ L1


def test_l1_serves_reused_items_without_the_store(redis_server: Any, namespace: str,
                                                  tmp_path: Path) -> None:
    ds = Recorded(N, str(tmp_path / "log"))
    dp = ac.AsyncKVCacheMapDataPipe(ds, ac.connect(redis_server.url), namespace=namespace,
                                    l1_bytes=1 << 20)
    first = [dp[i] for i in range(N)]
    before = dp.stats()["batches"]
    for _validation_pass in range(3):
        again = [dp[i] for i in range(N)]
        assert [v["i"] for v in again] == list(range(N))
    stats = dp.stats()
    dp.close()
    assert stats["batches"] == before  # no store request after the first pass
    assert stats["l1_hits"] == 3 * N
    assert computed(ds.log) == list(range(N))
    assert all(torch.equal(a["t"], b["t"]) for a, b in zip(first, again))


def test_l1_hands_out_fresh_objects(redis_server: Any, namespace: str, tmp_path: Path) -> None:
    """A consumer that changes a sample in place never changes the next reader's."""
    dp = ac.AsyncKVCacheMapDataPipe(Recorded(N, str(tmp_path / "log")),
                                    ac.connect(redis_server.url), namespace=namespace,
                                    l1_bytes=1 << 20)
    sample = dp[3]
    sample["t"].mul_(0)  # an in-place augmentation
    assert torch.equal(dp[3]["t"], torch.full((64,), 3.0))
    assert dp[3] is not dp[3]
    dp.close()


def test_l1_is_bounded_and_least_recently_used_goes_first(namespace: str) -> None:
    from asynccache.cache.l1 import L1Cache

    l1 = L1Cache(10_000)
    for i in range(100):
        l1.put(b"k%d" % i, bytes(900))
    assert l1.size <= 10_000 and len(l1) == 9  # 1,003 bytes an entry with its overhead
    assert l1.get(b"k90") is None and l1.get(b"k91") is not None
    l1.get(b"k92")  # used: kept over k93 when the next one comes in
    l1.put(b"new", bytes(900))
    assert l1.get(b"k92") is not None and l1.get(b"k93") is None
    l1.put(b"huge", bytes(20_000))  # larger than the tier: not kept, nothing evicted
    assert l1.get(b"huge") is None and len(l1) == 9


def test_l1_on_the_node_and_the_async_cache(memcached_server: Any, namespace: str,
                                            tmp_path: Path) -> None:
    ds = Recorded(N, str(tmp_path / "log"))
    node = CachedMapper(SamplerWrapper(RandomSampler(range(N))), ds.__getitem__,
                        ac.connect(memcached_server.url), namespace=namespace,
                        l1_bytes=1 << 20)
    from torchdata.nodes import Loader

    loader = Loader(node)
    list(loader)
    list(loader)
    stats = node.stats()
    node.close()
    assert stats["l1_hits"] == N and len(computed(ds.log)) == N


@pytest.mark.anyio
async def test_l1_in_get_many(redis_server: Any, namespace: str) -> None:
    client = ac.connect(redis_server.url)
    cache = ac.AsyncKVCache(client, namespace=namespace, l1_bytes=1 << 16)
    await cache.set_many({i: i * i for i in range(10)})
    batches = cache.stats()["batches"]
    assert await cache.get_many(range(12)) == {i: i * i for i in range(10)}
    stats = cache.stats()
    assert stats["l1_hits"] == 10 and stats["batches"] == batches + 1  # only 10, 11 asked
    with pytest.raises(ac.ConfigError, match="l1_bytes"):
        ac.AsyncKVCache(client, namespace=namespace, l1_bytes=-1)
    await client.close()


# ---------------------------------------------------------------------- StatefulDataLoader


def resumed_after_five_batches(make: Callable[[], StatefulDataLoader]) -> list[list[int]]:
    """The indices of an epoch read as 5 batches, a saved state, and the rest from a fresh
    loader that loaded that state."""
    loader = make()
    it = iter(loader)
    head = [[v["i"] for v in next(it)] for _ in range(5)]
    state = loader.state_dict()
    del it
    fresh = make()
    fresh.load_state_dict(state)
    return head + [[v["i"] for v in b] for b in fresh]


@pytest.mark.parametrize("workers", [0, 2])
def test_pipe_resumes_under_stateful_dataloader(redis_server: Any, namespace: str,
                                                tmp_path: Path, workers: int) -> None:
    log = str(tmp_path / "log")

    def make() -> StatefulDataLoader:
        dp = ac.AsyncKVCacheMapDataPipe(Recorded(N, log), ac.connect(redis_server.url),
                                        namespace=namespace)
        return StatefulDataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=workers,
                                  generator=torch.Generator().manual_seed(4),
                                  collate_fn=listed,
                                  multiprocessing_context="fork" if workers else None)

    reference = [[v["i"] for v in b] for b in make()]  # computes and caches everything
    assert sorted(computed(log)) == list(range(N))
    os.unlink(log)
    assert resumed_after_five_batches(make) == reference
    assert computed(log) == []  # every sample came from the cache


@pytest.mark.parametrize("workers", [0, 2])
def test_node_resumes_under_stateful_dataloader(redis_server: Any, namespace: str,
                                                tmp_path: Path, workers: int) -> None:
    log = str(tmp_path / "log")
    url = redis_server.url

    def make() -> StatefulDataLoader:
        ds = Recorded(N, log)
        iterable = NodeIterable(lambda w, n: _worker_node(ds, url, namespace, w, n))
        return StatefulDataLoader(iterable, batch_size=BATCH, num_workers=workers,
                                  collate_fn=listed,
                                  multiprocessing_context="fork" if workers else None)

    reference = [[v["i"] for v in b] for b in make()]
    assert sorted(i for b in reference for i in b) == list(range(N))
    computed_before = len(computed(log))
    assert resumed_after_five_batches(make) == reference
    assert len(computed(log)) == computed_before  # the resumed run computed nothing


def _worker_node(ds: Recorded, url: str, namespace: str, worker: int, workers: int
                 ) -> CachedMapper[Any]:
    order = torch.randperm(N, generator=torch.Generator().manual_seed(9)).tolist()
    shard = order[worker::workers]
    return CachedMapper(SamplerWrapper(_ListSampler(shard)), ds.__getitem__, ac.connect(url),
                        namespace=namespace, prefetch=8)


class _ListSampler(torch.utils.data.Sampler[int]):
    def __init__(self, items: list[int]) -> None:
        self.items = items

    def __iter__(self) -> Any:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def test_a_stateful_sampler_the_pipe_follows_resumes_mid_epoch_where_it_stopped() -> None:
    """num_workers=0, order= the loader's own StatefulDistributedSampler: drawing the plan
    must not move the sampler's count of what it yielded (a checkpoint taken mid-epoch
    would resume past the end of the epoch: the rest of it silently skipped)."""
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def sampler() -> StatefulDistributedSampler:
        return StatefulDistributedSampler(list(range(64)), num_replicas=1, rank=0, seed=1)

    user = sampler()
    with ac.AsyncKVCacheMapDataPipe(list(range(64)), ac.connect("memory://stateful-order"),
                                    namespace="stateful-order", order=user,
                                    prefetch=16) as dp:
        loader = StatefulDataLoader(dp, sampler=user, batch_size=8, collate_fn=listed)
        user.set_epoch(0)
        list(loader)
        user.set_epoch(1)
        it = iter(loader)
        seen = [next(it), next(it)]
        state = loader.state_dict()
    assert user.yielded == 16
    again = sampler()
    resumed = StatefulDataLoader(list(range(64)), sampler=again, batch_size=8,
                                 collate_fn=listed)
    again.set_epoch(1)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 6 and sorted(i for b in seen + rest for i in b) == list(range(64))


def _unnamed_worker_node(ds: Recorded, url: str, worker: int, workers: int
                         ) -> CachedMapper[Any]:
    shard = list(range(N))[worker::workers]
    return CachedMapper(SamplerWrapper(_ListSampler(shard)), ds.__getitem__, ac.connect(url),
                        prefetch=8)  # no namespace=


def test_an_unnamed_node_built_in_each_worker_reuses_its_values_every_epoch(
        redis_server: Any, tmp_path: Path) -> None:
    """NodeIterable builds each worker's node anew every epoch (fresh workers): a node
    made without namespace= reads what the same node of the earlier epochs wrote, and
    another NodeIterable's node never does (issue 38, slice 5)."""
    log = str(tmp_path / "log")
    url = redis_server.url
    ds = Recorded(N, log)
    iterable = NodeIterable(lambda w, n: _unnamed_worker_node(ds, url, w, n))
    loader = DataLoader(iterable, batch_size=BATCH, num_workers=2, collate_fn=listed,
                        multiprocessing_context="fork")
    for epoch in range(3):
        got = sorted(v["i"] for batch in loader for v in batch)
        assert got == list(range(N))
        if epoch == 0:
            assert sorted(computed(log)) == list(range(N))
            os.unlink(log)
    assert computed(log) == []  # epochs 2 and 3 were read, not computed (was: every item)
    other = NodeIterable(lambda w, n: _unnamed_worker_node(ds, url, w, n))
    assert sorted(v["i"] for batch in DataLoader(other, batch_size=BATCH, collate_fn=listed)
                  for v in batch) == list(range(N))
    assert sorted(computed(log)) == list(range(N))  # another pipeline: its own values
