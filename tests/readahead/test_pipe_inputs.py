"""What a pipe accepts: integer-likes, keyed sources, every form of ``order``, threads.

Real servers (the pipe_url fixture below covers the consumer-socket path of Redis and
the loop-thread path of the other stores).
"""

from __future__ import annotations

import concurrent.futures
import functools
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.map import SequenceWrapper
from torchdata.nodes import IterableWrapper, Loader, ParallelMapper

import asynccache as ac


class Source:
    """index -> a value that names it (wrong values are visible), with a call count."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict[str, int]:  # torch's DataLoader pickles the graph
        return {"n": self.n}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["n"])  # type: ignore[misc]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        with self.lock:
            self.calls += 1
        return {"i": index, "t": torch.full((3,), float(index))}


def check(value: dict[str, Any], index: int) -> None:
    assert value["i"] == index and torch.equal(value["t"], torch.full((3,), float(index)))


@pytest.fixture(params=["redis_server", "memcached_server", "redis_cluster"])
def pipe_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param).url


def test_integer_likes_are_indices(pipe_url: str, namespace: str) -> None:
    source = Source(50)
    with ac.AsyncKVCacheMapDataPipe(source, ac.connect(pipe_url), namespace=namespace) as dp:
        for index in (np.int64(3), np.uint16(4), torch.tensor(5), torch.tensor([6])[0], -1):
            value = dp[index]
            check(value, int(index) % 50)
        assert dp.key_for(3) == f"ac:{namespace}:3".encode()
        got = dp.__getitems__([np.int32(7), torch.tensor(8), 9])
        for value, index in zip(got, (7, 8, 9)):
            check(value, index)
        with pytest.raises(IndexError):
            dp[np.int64(50)]
        with pytest.raises(ac.KeyEncodingError, match=r"int\(i\)") as raised:
            dp[1.5]  # as documented in docs/pytorch.md, and a TypeError as a list's
        assert isinstance(raised.value, TypeError)


def test_numpy_sampler_in_a_dataloader(pipe_url: str, namespace: str) -> None:
    source = Source(64)
    dp = ac.AsyncKVCacheMapDataPipe(source, ac.connect(pipe_url), namespace=namespace)
    order = np.random.default_rng(0).permutation(64)
    loader = DataLoader(dp, batch_size=8, sampler=order, collate_fn=list)
    for _epoch in range(2):
        got = [v["i"] for batch in loader for v in batch]
        assert got == order.tolist()
    assert source.calls == 64  # the second epoch came from the store
    dp.close()


def times_ten(calls: list[object], x: int) -> int:
    calls.append(x)
    return x * 10


def test_dict_backed_source_is_cached_under_its_keys(pipe_url: str, namespace: str) -> None:
    data = {"cat": 1, "dog": 2, "5": 3, 5: 4, ("a", 1): 5}
    calls: list[object] = []
    record = functools.partial(times_ten, calls)
    dp = SequenceWrapper(data).map(record).async_kv_cache(ac.connect(pipe_url),
                                                           namespace=namespace)
    assert dp.key_for("cat") == f"ac:{namespace}:s:cat".encode()
    assert dp.key_for("5") != dp.key_for(5)
    for _ in range(2):
        assert [dp[k] for k in data] == [10, 20, 30, 40, 50]
        dp.flush()
    assert list(dp) == [10, 20, 30, 40, 50]  # iteration follows the mapping's keys
    assert sorted(calls) == [1, 2, 3, 4, 5]  # each computed once, then served
    with pytest.raises(ac.KeyEncodingError):
        dp[1.5]
    dp.close()


def order_forms(n: int) -> Iterator[tuple[str, object]]:
    perm = list(range(n))
    random.Random(2).shuffle(perm)
    yield "list", perm
    yield "tuple", tuple(perm)
    yield "numpy", np.array(perm)
    yield "tensor", torch.tensor(perm)
    yield "randperm", torch.randperm(n, generator=torch.Generator().manual_seed(1))
    yield "generator", (i for i in perm)
    yield "sampler", torch.utils.data.SequentialSampler(range(n))


@pytest.mark.parametrize("form", [name for name, _ in order_forms(1)])
def test_every_order_form_is_followed(redis_server: Any, namespace: str, form: str) -> None:
    n = 200
    order = dict(order_forms(n))[form]
    expected = (order.tolist() if hasattr(order, "tolist") else list(order)) \
        if form != "generator" else None
    fill = ac.AsyncKVCacheMapDataPipe(Source(n), ac.connect(redis_server.url),
                                      namespace=namespace)
    fill.__getitems__(list(range(n)))
    fill.close()
    dp = ac.AsyncKVCacheMapDataPipe(Source(n), ac.connect(redis_server.url),
                                    namespace=namespace, order=order)
    plan = expected if expected is not None else list(dp.order)  # type: ignore[arg-type]
    for _epoch in range(2):  # re-iterated when used up
        for index in plan:
            check(dp[index], int(index))
    stats = dp.stats()
    dp.close()
    assert stats["direct_reads"] <= 2, stats
    assert stats["prefetch_hits"] + stats["stalls"] >= 2 * n - 2


def test_empty_order_is_a_config_error() -> None:
    client = ac.connect("memory://orders")
    with pytest.raises(ac.ConfigError, match="order is empty"):
        ac.AsyncKVCacheMapDataPipe(Source(5), client, namespace="o", order=[])
    with pytest.raises(ac.ConfigError, match="order is empty"):
        ac.AsyncKVCacheMapDataPipe(Source(5), client, namespace="o", order=iter([]))
    with pytest.raises(ac.ConfigError, match="does not have"):
        dp = ac.AsyncKVCacheMapDataPipe(Source(5), client, namespace="o", order=[1, 9])
        dp[1]


def test_threads_share_one_pipe(pipe_url: str, namespace: str) -> None:
    """4 threads, dp[i] and __getitems__ mixed: every value right, counters exact."""
    n = 600
    source = Source(n)
    dp = ac.AsyncKVCacheMapDataPipe(source, ac.connect(pipe_url), namespace=namespace,
                                    prefetch=32)
    reads = [0] * 4

    def worker(t: int) -> None:
        rng = random.Random(t)
        for epoch in range(3):
            start = rng.randrange(n)
            for step in range(150):
                if step % 10 == 0:
                    batch = [rng.randrange(n) for _ in range(8)]
                    for value, index in zip(dp.__getitems__(batch), batch):
                        check(value, index)
                    reads[t] += 8
                else:
                    index = (start + step + epoch) % n  # sequential runs: read-ahead kicks in
                    check(dp[index], index)
                    reads[t] += 1

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(worker, t) for t in range(4)]:
            future.result()
    dp.flush()
    stats = dp.stats()
    dp.close()
    assert stats["hits"] + stats["misses"] + stats["recalled"] == sum(reads)
    assert stats["computed"] == source.calls <= stats["misses"]  # a batch may repeat an index
    assert stats["errors"] == 0


def test_parallel_mapper_threads_over_getitem(pipe_url: str, namespace: str) -> None:
    n = 300
    dp = ac.AsyncKVCacheMapDataPipe(Source(n), ac.connect(pipe_url), namespace=namespace)
    order = list(range(n))
    random.Random(4).shuffle(order)
    for _epoch in range(2):
        node = ParallelMapper(IterableWrapper(order), dp.__getitem__, num_workers=4,
                              method="thread")
        got = list(Loader(node))
        for value, index in zip(got, order):
            check(value, index)
    stats = dp.stats()
    dp.close()
    assert stats["computed"] == n and stats["hits"] == n and stats["errors"] == 0


def test_threads_starting_together_share_one_runtime(redis_server: Any, namespace: str) -> None:
    """Found by the soak test: 4 threads reading a fresh pipe at once each built a
    runtime, and all but one were dropped with their sockets open and counters lost."""
    dp = ac.AsyncKVCacheMapDataPipe(Source(64), ac.connect(redis_server.url),
                                    namespace=namespace)
    barrier = threading.Barrier(8)
    runtimes = set()

    def first_read(t: int) -> None:
        barrier.wait()
        check(dp[t], t)
        runtimes.add(id(dp._rt))

    threads = [threading.Thread(target=first_read, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = dp.stats()
    dp.close()
    assert len(runtimes) == 1
    assert stats["hits"] + stats["misses"] == 8


def test_key_for_never_truncates(redis_server: Any, namespace: str) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(Source(8), ac.connect(redis_server.url), namespace=namespace)
    assert dp.key_for(np.int64(3)) == dp.key_for(3) == f"ac:{namespace}:3".encode()
    for bad in (1.5, torch.tensor(1.5)):
        with pytest.raises(ac.KeyEncodingError):
            dp.key_for(bad)
    assert dp.key_for(None) == f"ac:{namespace}:n:".encode()  # a key of its own kind
    with pytest.raises(TypeError, match="integers"):
        dp[None]
