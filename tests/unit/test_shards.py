"""ThreadShards, the counters and the histograms kept in it: exact under threads, and
ended threads' shards folded into one (a pool that churns threads does not grow it)."""

from __future__ import annotations

import threading

from asynccache.observe.histogram import Histograms
from asynccache.observe.shards import ThreadShards
from asynccache.observe.stats import Counters


def _fold(into: list[int], shard: list[int]) -> None:
    into[0] += shard[0]


def _run_threads(n: int, work: object) -> None:
    threads = [threading.Thread(target=work) for _ in range(n)]  # type: ignore[arg-type]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_each_thread_writes_its_own_shard_and_the_total_sums_them() -> None:
    shards: ThreadShards[list[int]] = ThreadShards(lambda: [0], _fold)
    seen: list[int] = []

    def work() -> None:
        mine = shards.mine()
        assert shards.mine() is mine  # the same shard on every call of one thread
        seen.append(id(mine))
        for _ in range(10_000):
            mine[0] += 1

    _run_threads(8, work)
    assert len(set(seen)) == 8
    assert shards.total() == [80_000]
    assert shards.total() == [80_000]  # folding ended threads loses nothing


def test_ended_threads_are_folded_into_one() -> None:
    shards: ThreadShards[list[int]] = ThreadShards(lambda: [0], _fold)
    for _ in range(20):
        _run_threads(1, lambda: shards.mine().__setitem__(0, 5))
    shards.mine()[0] += 1  # this thread's, alive
    assert shards.total() == [101]
    assert len(shards._live) == 1  # only this thread's shard is kept apart


def test_counters_and_histograms_are_exact_under_threads() -> None:
    counters = Counters(["a", "b"])
    histograms = Histograms()

    def work() -> None:
        for _ in range(2_000):
            counters.add("a")
            histograms.record("read", 1_000)

    _run_threads(4, work)
    counters.add("b", 3)
    assert counters.snapshot() == {"a": 8_000, "b": 3}
    latency = histograms.snapshot()
    assert latency["read"].count == 8_000 and latency["read"].sum_ns == 8_000_000
    assert latency["write"].count == 0
