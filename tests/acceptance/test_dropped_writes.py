"""Read your writes when the store does not take them: a value whose write was dropped
(the write-behind queue overflowed) or failed (a slow link timed it out) is still what
this process reads again, never a new computation. The store sits behind the project's
fault proxy with a trickled upload; the source draws random bytes, so a value computed
twice would differ.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import asynccache as ac
from asynccache.cache.write_queue import WriteQueue
from asynccache.testing.proxy import FaultProxy, url_through

N = 12_000  # over the write-behind queue's 10,000 values: the oldest are dropped
EVERY = 10  # the keys read again


class RandomSource:
    """Every computation is new: ``source[i]`` twice gives two different values."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        return index, os.urandom(1_000)


@pytest.fixture(params=["redis", "memcached"])
def slow_store(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, str]]:
    server = request.getfixturevalue(f"{request.param}_server")
    with FaultProxy(server.host, server.port) as proxy:
        proxy.set_trickle(20_000, 0.1, direction="up")  # 200 kB/s towards the store
        yield proxy, url_through(proxy, server.url)


def test_the_pipe_reads_its_dropped_writes(slow_store: tuple[FaultProxy, str],
                                           namespace: str) -> None:
    proxy, url = slow_store
    with ac.AsyncKVCacheMapDataPipe(RandomSource(), ac.connect(url, timeout=0.5),
                                    prefetch=64, namespace=namespace) as dp:
        first = {i: dp[i] for i in range(N)}
        again = {i: dp[i] for i in range(0, N, EVERY)}
        stats = dp.stats()
        proxy.set_trickle(0)
    # the case is the one this guards: writes were lost on the way (or queued for long)
    assert stats["writes_dropped"] > 0 or stats["recalled"] > 0, stats
    wrong = [i for i, value in again.items() if value != first[i]]
    assert wrong == [], f"{len(wrong)} of {len(again)} re-reads returned another value"
    assert stats["computed"] == N, stats


@pytest.mark.xfail(strict=False, reason=(
    "known hole, not fixed yet: with a busy machine a few of 1,200 re-reads through the node "
    "(2-7 in the last CI run) still return a new value; the pipe's path holds. See the stop "
    "note of 2026-12-06 (issue 30)."))
def test_the_node_reads_its_dropped_writes(slow_store: tuple[FaultProxy, str],
                                           namespace: str) -> None:
    pytest.importorskip("torchdata.nodes")
    from torchdata.nodes import IterableWrapper

    from asynccache.nodes import CachedMapper

    proxy, url = slow_store
    source = RandomSource()
    # each index twice: first pass, then every 10th again (a sampler with replacement)
    order = list(range(N)) + list(range(0, N, EVERY))
    node = CachedMapper(IterableWrapper(order), source.__getitem__,
                        ac.connect(url, timeout=0.5), prefetch=64, namespace=namespace)
    try:
        node.reset()
        seen: dict[int, Any] = {}
        wrong = 0
        for value in iter(node.next, None):  # pragma: no branch
            index = value[0]
            if index in seen and seen[index] != value:
                wrong += 1
            seen.setdefault(index, value)
            if len(seen) == N and index == order[-1]:
                break
        proxy.set_trickle(0)
    finally:
        node.close()
    assert wrong == 0, f"{wrong} re-reads returned another value"


def test_past_the_budget_kept_values_are_forgotten_and_counted() -> None:
    queue = WriteQueue(max_pending=2, keep_bytes=250)
    blobs = {f"k{i}".encode(): bytes([i]) * 100 for i in range(5)}
    for key, blob in blobs.items():
        queue.put({key: blob}, {key: blob})
    # 3 dropped from the queue (oldest first), 2 of them fit in 250 bytes
    queued, _again, kept = queue.own_writes(list(blobs))
    assert set(queued) == {b"k3", b"k4"} and set(kept) == {b"k1", b"k2"}
    assert queue.take_forgotten() == 1 and queue.kept_bytes == 200
    # a new write of a kept key replaces it: the new value is the one recalled
    queue.put({b"k1": b"new"}, {b"k1": b"new"})
    assert queue.own_writes([b"k1"])[0] == {b"k1": b"new"}


def test_a_failed_batch_is_kept_and_expires_with_the_ttl() -> None:
    queue = WriteQueue(max_pending=10, ttl=0.0)
    queue.put({b"a": b"1"}, {b"a": b"1"})
    batch = queue.take(10)
    assert batch is not None
    queue.done(batch, written=False)
    assert queue.own_writes([b"a"]) == ({}, [b"a"], {})  # ttl 0: expired in the store too
    kept = WriteQueue(max_pending=10)
    kept.put({b"a": b"1"}, {b"a": b"1"})
    batch = kept.take(10)
    assert batch is not None
    kept.done(batch, written=False)
    assert kept.own_writes([b"a"])[2] == {b"a": b"1"}  # kept: the caller writes it again


def test_a_close_that_runs_out_of_time_says_what_it_dropped(
        slow_store: tuple[FaultProxy, str], namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: "flush failed (url):  — falling back", an empty reason for 1,724 dropped
    writes. Now the warning says how many, why, and which setting to raise."""
    proxy, url = slow_store
    dp = ac.AsyncKVCacheMapDataPipe(RandomSource(), ac.connect(url, timeout=5),
                                    prefetch=64, namespace=namespace)
    try:
        with caplog.at_level("WARNING", logger="asynccache"):
            for i in range(2_000):  # misses: their writes queue up behind the reads
                dp[i]
            dp.close(timeout=0.2)  # 2 MB at 200 kB/s: not in 0.2 s
    finally:
        proxy.set_trickle(0)
    warnings = [r.getMessage() for r in caplog.records if "flush failed" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "queued writes were not all in the store after the close's timeout=0.2s" \
        in warnings[0] and "pass a larger timeout= to close()" in warnings[0]
    assert dp.stats()["writes_dropped"] > 0
