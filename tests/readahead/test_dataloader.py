"""torch DataLoader with worker processes sharing one cache through a real Redis.

Source calls are counted across processes by appending one line per computed item to a
file (O_APPEND writes of a few bytes are atomic), which works under fork and spawn.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import asynccache as ac
from asynccache.testing import servers
from conftest import computed, record_computation


class FileCountedSource(torch.utils.data.Dataset):
    """Items whose computation is recorded in a file shared by all processes."""

    def __init__(self, n: int, log: Path) -> None:
        self.n = n
        self.log = str(log)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, object]:
        record_computation(self.log, index)
        return {"index": index, "x": torch.full((8,), float(index)), "none": None}



@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    yield
    gc.collect()


def run_epoch(dp: object, workers: int, method: str | None, persistent: bool,
              loader: DataLoader | None = None) -> tuple[list[int], DataLoader]:
    if loader is None:
        loader = DataLoader(
            dp, batch_size=16, shuffle=True, num_workers=workers,
            multiprocessing_context=method if workers else None,
            persistent_workers=persistent, collate_fn=list_collate,
        )
    seen: list[int] = []
    for batch in loader:
        for item in batch:
            assert torch.equal(item["x"], torch.full((8,), float(item["index"])))
            assert item["none"] is None
            seen.append(item["index"])
    return seen, loader


def list_collate(batch: list[object]) -> list[object]:
    return batch


@pytest.mark.parametrize(
    ("workers", "method", "persistent"),
    [
        (0, None, False),
        (2, "fork", False),
        (2, "fork", True),
        (2, "spawn", False),
        (2, "forkserver", False),
    ],
)
def test_epoch_two_computes_nothing(redis_server: servers.RedisServer, namespace: str,
                                    tmp_path: Path, workers: int, method: str | None,
                                    persistent: bool) -> None:
    n = 300
    log = tmp_path / "computed.log"
    # a generous timeout: on a loaded 2-core box a 1 s timeout turns hits into (correct) misses
    client = ac.connect(redis_server.url, timeout=10)
    dp = ac.AsyncKVCacheMapDataPipe(FileCountedSource(n, log), client,
                                    prefetch=32, namespace=namespace)
    try:
        check_two_epochs(dp, log, n, workers, method, persistent)
    finally:
        dp.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_epoch_two_computes_nothing_when_writes_trail_by_a_batch(
    redis_server: servers.RedisServer, namespace: str, tmp_path: Path, persistent: bool
) -> None:
    """Following the sampler, a worker's batch returns before its writes are in (they
    are in before its next batch returns, and its last batch of the epoch waits for
    its own): epoch 2 still computes nothing, persistent workers or not."""
    n = 300
    log = tmp_path / "computed.log"
    client = ac.connect(redis_server.url, timeout=10)
    dp = ac.AsyncKVCacheMapDataPipe(FileCountedSource(n, log), client,
                                    prefetch=32, namespace=namespace)
    try:
        loader = DataLoader(dp, batch_size=16, shuffle=True, num_workers=2,
                            multiprocessing_context="fork", persistent_workers=persistent,
                            collate_fn=list_collate)
        dp.set_order(loader.batch_sampler)
        seen, _ = run_epoch(dp, 2, "fork", persistent, loader)
        assert sorted(seen) == list(range(n))
        first = computed(log)
        assert sorted(first) == list(range(n))
        seen2, _ = run_epoch(dp, 2, "fork", persistent, loader)
        assert sorted(seen2) == list(range(n))
        assert computed(log) == first, "epoch 2 recomputed items that epoch 1 cached"
    finally:
        dp.close()


def check_two_epochs(dp: ac.AsyncKVCacheMapDataPipe, log: Path, n: int, workers: int,
                     method: str | None, persistent: bool) -> None:
    expected = list(range(n))
    if method == "fork":
        assert dp[0]["index"] == 0  # the pipe runs in the parent before the fork
        dp.flush()
    seen, loader = run_epoch(dp, workers, method, persistent)
    assert sorted(seen) == list(range(n))
    first = computed(log)
    assert sorted(first) == expected  # each item computed exactly once, across workers
    seen2, _ = run_epoch(dp, workers, method, persistent, loader if persistent else None)
    assert sorted(seen2) == list(range(n))
    assert computed(log) == first, "epoch 2 recomputed items that epoch 1 cached"


def test_dataloader_reads_whole_batches(redis_server: servers.RedisServer, namespace: str,
                                        tmp_path: Path) -> None:
    """DataLoader wraps MapDataPipes; batches must still reach __getitems__ (one request)."""
    dp = ac.AsyncKVCacheMapDataPipe(FileCountedSource(256, tmp_path / "log"),
                                    ac.connect(redis_server.url), prefetch=0,
                                    namespace=namespace)
    try:
        loader = DataLoader(dp, batch_size=32, shuffle=True, collate_fn=list_collate)
        assert sum(len(b) for b in loader) == 256
        assert sum(len(b) for b in loader) == 256
        stats = dp.stats()
    finally:
        dp.close()
    assert stats["batches"] == 16  # 8 batches per epoch, one multi-get each
    assert stats["hits"] == 256 and stats["misses"] == 256
