"""``asynccache.nodes.CachedMapper`` with real torchdata objects on real servers."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler
from torchdata.nodes import (
    Batcher,
    IterableWrapper,
    Loader,
    ParallelMapper,
    Prefetcher,
    SamplerWrapper,
)

import asynccache as ac
from asynccache.nodes import CachedMapper
from asynccache.testing import servers
from conftest import computed, record_computation

N = 120


class Dataset(torch.utils.data.Dataset):
    """index -> a value naming it; computations recorded in a file (any process)."""

    def __init__(self, n: int, log: str) -> None:
        self.n = n
        self.log = log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        record_computation(self.log, index)
        return {"i": index, "t": torch.full((2,), float(index))}



def shuffled(n: int, seed: int = 0) -> RandomSampler:
    return RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["redis_server", "memcached_server", "redis_cluster"])
def node_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param).url


@pytest.fixture
def ds(tmp_path: Path) -> Dataset:
    return Dataset(N, str(tmp_path / "computed"))


def indices(values: list[dict[str, Any]]) -> list[int]:
    return [v["i"] for v in values]


def test_yields_map_fn_of_each_item_in_order_and_epoch_two_computes_nothing(
        node_url: str, namespace: str, ds: Dataset) -> None:
    sampler = shuffled(N)
    node = CachedMapper(SamplerWrapper(sampler), ds.__getitem__, ac.connect(node_url),
                        namespace=namespace, prefetch=16)
    loader = Loader(node)
    first = list(loader)
    order = list(shuffled(N))  # the same generator seed: the first epoch's order
    assert indices(first) == order
    assert sorted(computed(Path(ds.log))) == list(range(N))
    second = list(loader)  # a new epoch: a new permutation, all from the store
    assert sorted(indices(second)) == list(range(N)) and indices(second) != order
    assert len(computed(Path(ds.log))) == N
    stats = node.stats()
    node.close()
    assert stats["hits"] == N and stats["misses"] == N and stats["computed"] == N
    # a hit of epoch two was ready (a prefetch hit) or waited for (a stall); a miss read
    # ahead is no prefetch hit (the pipe's meaning, one engine)
    assert stats["prefetch_hits"] <= stats["hits"]
    assert N <= stats["prefetch_hits"] + stats["stalls"] <= 2 * N
    assert stats["batches"] <= 2 * (N // 8 + 2)  # batched reads, not one per item


def test_keys_are_shared_with_the_pipe(node_url: str, namespace: str, ds: Dataset) -> None:
    client = ac.connect(node_url)
    pipe = ac.AsyncKVCacheMapDataPipe(ds, client, namespace=namespace)
    pipe.__getitems__(list(range(N // 2)))  # the pipe computes the first half
    pipe.close()
    node = CachedMapper(SamplerWrapper(SequentialSampler(range(N))), ds.__getitem__, client,
                        namespace=namespace)
    assert node.key_for(7) == pipe.key_for(7)
    assert indices(list(Loader(node))) == list(range(N))
    node.close()
    assert sorted(computed(Path(ds.log))) == list(range(N))  # nothing computed twice
    again = ac.AsyncKVCacheMapDataPipe(ds, client, namespace=namespace)
    assert indices(again.__getitems__(list(range(N)))) == list(range(N))
    assert again.stats()["misses"] == 0  # the node's half is the pipe's too
    again.close()


@pytest.mark.parametrize("stop_at", [0, 1, 7, 33, N - 1])
@pytest.mark.parametrize("snapshot_frequency", [1, 10])
def test_resume_yields_exactly_the_remaining_items(
        redis_server: Any, namespace: str, ds: Dataset, stop_at: int,
        snapshot_frequency: int) -> None:
    def make() -> Loader:
        node = CachedMapper(SamplerWrapper(shuffled(N, seed=3)), ds.__getitem__,
                            ac.connect(redis_server.url), namespace=namespace, prefetch=16,
                            snapshot_frequency=snapshot_frequency)
        return Loader(node)

    full = indices(list(make()))
    loader = make()
    it = iter(loader)
    head = [next(it)["i"] for _ in range(stop_at)]  # read-ahead is in flight here
    state = loader.state_dict()
    fresh = make()
    fresh.load_state_dict(state)
    tail = indices(list(fresh))
    assert head + tail == full


def test_resume_with_misses_computed_ahead_in_threads(redis_server: Any, namespace: str,
                                                      ds: Dataset) -> None:
    def make() -> Loader:
        return Loader(CachedMapper(SamplerWrapper(shuffled(N, seed=5)), ds.__getitem__,
                                   ac.connect(redis_server.url), namespace=namespace,
                                   num_workers=3))

    loader = make()
    it = iter(loader)
    head = [next(it)["i"] for _ in range(40)]
    state = loader.state_dict()
    fresh = make()
    fresh.load_state_dict(state)
    assert head + indices(list(fresh)) == list(shuffled(N, seed=5))


@pytest.mark.parametrize("method", ["thread", "process"])
def test_misses_computed_ahead_by_workers(redis_server: Any, namespace: str, ds: Dataset,
                                          method: str) -> None:
    node = CachedMapper(SamplerWrapper(shuffled(N)), ds.__getitem__,
                        ac.connect(redis_server.url), namespace=namespace, num_workers=2,
                        method=method, multiprocessing_context="fork")
    assert indices(list(Loader(node))) == list(shuffled(N))
    stats = node.stats()
    node.close()
    assert stats["misses"] == N and stats["computed_ahead"] > N // 2
    assert sorted(computed(Path(ds.log))) == list(range(N))


def test_under_batcher_and_prefetcher(node_url: str, namespace: str, ds: Dataset) -> None:
    node = CachedMapper(SamplerWrapper(shuffled(N)), ds.__getitem__, ac.connect(node_url),
                        namespace=namespace)
    loader = Loader(Prefetcher(Batcher(node, batch_size=8), prefetch_factor=2))
    for _epoch in range(2):  # the node runs in the Prefetcher's thread, a new one per epoch
        batches = list(loader)
        assert all(len(b) == 8 for b in batches)
        assert sorted(v["i"] for b in batches for v in b) == list(range(N))
    node.close()
    assert len(computed(Path(ds.log))) == N


@pytest.mark.parametrize("method", ["thread", "process"])
def test_inside_parallel_mapper_pipelines(redis_server: Any, namespace: str, ds: Dataset,
                                          method: str) -> None:
    node = CachedMapper(SamplerWrapper(shuffled(N)), ds.__getitem__,
                        ac.connect(redis_server.url), namespace=namespace)
    pipeline = ParallelMapper(node, _double_index, num_workers=2, method=method,
                              multiprocessing_context="fork")
    for _epoch in range(2):
        got = list(Loader(pipeline))
        assert sorted(got) == [2 * i for i in range(N)]
    node.close()
    assert len(computed(Path(ds.log))) == N


def _double_index(value: dict[str, Any]) -> int:
    return 2 * value["i"]


def test_over_an_iterable_of_keys(redis_server: Any, namespace: str) -> None:
    calls: list[str] = []
    lock = threading.Lock()

    def load(name: str) -> str:
        with lock:
            calls.append(name)
        return name.upper()

    names = ["cat.jpg", "dog.jpg", "cat.jpg", "eel.jpg"]
    for _ in range(2):
        node = CachedMapper(IterableWrapper(names), load, ac.connect(redis_server.url),
                            namespace=namespace, prefetch=2)
        assert list(Loader(node)) == ["CAT.JPG", "DOG.JPG", "CAT.JPG", "EEL.JPG"]
        node.close()
    assert node.key_for("cat.jpg") == f"ac:{namespace}:s:cat.jpg".encode()
    assert sorted(set(calls)) == ["cat.jpg", "dog.jpg", "eel.jpg"] and len(calls) <= 4


def test_a_dead_store_still_yields_map_fn(namespace: str, ds: Dataset) -> None:
    port = servers.free_port()
    node = CachedMapper(SamplerWrapper(shuffled(N)), ds.__getitem__,
                        ac.connect(f"redis://127.0.0.1:{port}/0", timeout=0.2),
                        namespace=namespace)
    assert indices(list(Loader(node))) == list(shuffled(N))
    stats = node.stats()
    node.close()
    assert stats["errors"] >= 1 and stats["errors"] <= 5


def test_bad_arguments(ds: Dataset) -> None:
    client = ac.connect("memory://nodes")
    with pytest.raises(ac.ConfigError, match="BaseNode"):
        CachedMapper(range(3), ds.__getitem__, client)  # type: ignore[arg-type]
    with pytest.raises(ac.ConfigError, match="prefetch"):
        CachedMapper(IterableWrapper([1]), ds.__getitem__, client, prefetch=-1)
    with pytest.raises(ac.ConfigError, match="method"):
        CachedMapper(IterableWrapper([1]), ds.__getitem__, client, method="gpu")  # type: ignore[arg-type]
    node = CachedMapper(IterableWrapper([1]), ds.__getitem__, client)
    assert node.namespace.startswith("anon-")
    assert node.namespace != CachedMapper(IterableWrapper([2]), ds.__getitem__,
                                          client).namespace


def test_large_values_are_read_ahead_in_byte_bounded_requests(redis_server: Any,
                                                              namespace: str) -> None:
    """64 KiB values with readahead_bytes=512 KiB: requests of one value (1/8 of it is
    less than one encoded value), at most 8 values ahead, instead of 32-value requests;
    values still right."""
    n = 64
    blob = bytes(range(256)) * 256  # 64 KiB

    def big(i: int) -> bytes:
        return blob[:-8] + i.to_bytes(8, "little")

    client = ac.connect(redis_server.url)
    warm = ac.AsyncKVCacheMapDataPipe([big(i) for i in range(n)], client,
                                      namespace=namespace)
    warm.__getitems__(list(range(n)))
    warm.close()
    node = CachedMapper(SamplerWrapper(SequentialSampler(range(n))), big, client,
                        namespace=namespace, prefetch=64, readahead_bytes=512 * 1024)
    got = list(Loader(node))
    stats = node.stats()
    window = (node._sizer.window, node._sizer.batch)
    node.close()
    assert got == [big(i) for i in range(n)]
    assert stats["hits"] == n and stats["computed"] == 0
    assert window in ((7, 1), (8, 1))  # 512 KiB over values of 64 KiB + their header
    assert stats["batches"] >= n - 16  # after the first window, one value per request
