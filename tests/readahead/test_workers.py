"""DataLoader workers: read-ahead that follows the sampler, stats summed across workers."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import asynccache as ac

N = 256
BATCH = 16


class Source(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"i": index, "x": torch.full((4,), float(index))}


def listed(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


def loader_for(dp: Any, workers: int, *, persistent: bool = False, method: str = "fork",
               seed: int = 7) -> DataLoader:
    return DataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(seed), collate_fn=listed,
                      persistent_workers=persistent,
                      multiprocessing_context=method if workers else None)


def epoch(loader: DataLoader) -> list[int]:
    return [v["i"] for batch in loader for v in batch]


def warm(url: str, namespace: str) -> None:
    with ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect(url), namespace=namespace) as dp:
        dp.__getitems__(list(range(N)))


def settled(dp: Any, want: int, key: str = "hits") -> dict[str, int]:
    """Stats once the workers' reports (at most ~1 s old) add up to ``want`` reads."""
    deadline = time.monotonic() + 5
    while True:
        stats = dp.stats()
        if stats["hits"] + stats["misses"] >= want or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_stats_sum_every_worker(redis_server: Any, namespace: str, method: str) -> None:
    warm(redis_server.url, namespace)
    dp = ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect(redis_server.url),
                                    namespace=namespace)
    got = epoch(loader_for(dp, 2, method=method))
    assert sorted(got) == list(range(N))
    stats = settled(dp, N)  # the workers exited: their final reports
    assert stats["hits"] == N and stats["misses"] == 0
    per = dp.stats(per_process=True)
    assert len(per) == 3  # this process and the two workers
    assert sum(s["hits"] for s in per.values()) == N
    dp.close()


def test_persistent_workers_report_while_alive(redis_server: Any, namespace: str) -> None:
    warm(redis_server.url, namespace)
    dp = ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect(redis_server.url),
                                    namespace=namespace)
    loader = loader_for(dp, 2, persistent=True)
    epoch(loader)
    assert settled(dp, N)["hits"] == N  # reported within about a second
    epoch(loader)
    assert settled(dp, 2 * N)["hits"] == 2 * N
    dp.close()


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 > 2 cores
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("order_of", ["batch_sampler", "sampler"])
def test_read_ahead_follows_the_sampler_in_workers(redis_server: Any, namespace: str,
                                                   workers: int, order_of: str) -> None:
    """With the loader's (seeded) sampler as order, each worker reads ahead the batches
    that will come to it: warm shuffled epochs are prefetch hits, not one round trip per
    batch. Without it, every batch is a direct read."""
    warm(redis_server.url, namespace)
    results = {}
    for follow in (False, True):
        dp = ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect(redis_server.url),
                                        namespace=namespace)
        loader = loader_for(dp, workers)
        if follow:
            dp.set_order(getattr(loader, order_of))
        reference = epoch(loader_for(Source(N), 0))  # the same seed, no cache
        assert epoch(loader) == reference  # the cache never changes the training order
        results[follow] = settled(dp, N)
        dp.close()
    followed, blind = results[True], results[False]
    assert blind["prefetch_hits"] + blind["stalls"] < N // 4
    assert followed["prefetch_hits"] + followed["stalls"] >= 0.8 * N, followed
    assert followed["direct_reads"] <= 2 * workers * BATCH, followed


def test_persistent_workers_keep_following_epoch_after_epoch(redis_server: Any,
                                                            namespace: str) -> None:
    warm(redis_server.url, namespace)
    dp = ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect(redis_server.url),
                                    namespace=namespace)
    loader = loader_for(dp, 2, persistent=True)
    dp.set_order(loader.batch_sampler)
    for k in range(1, 4):
        epoch(loader)
        stats = settled(dp, k * N)
    assert stats["prefetch_hits"] + stats["stalls"] >= 0.8 * 3 * N, stats
    dp.close()


def test_following_in_the_main_process_never_changes_the_order(redis_server: Any,
                                                               namespace: str) -> None:
    """0 workers: the plan is drawn from a detached copy of the sampler, so the training
    order is exactly what it would be without asynccache."""
    warm(redis_server.url, namespace)
    dp = ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect(redis_server.url),
                                    namespace=namespace)
    loader = loader_for(dp, 0, seed=11)
    dp.set_order(loader.batch_sampler)
    reference = loader_for(Source(N), 0, seed=11)
    for _epoch in range(2):
        assert epoch(loader) == epoch(reference)
    dp.close()


class _LogTo:
    """A worker_init_fn: asynccache's warnings of each worker appended to one file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        import logging

        handler = logging.FileHandler(self.path)
        handler.setLevel(logging.WARNING)
        logging.getLogger("asynccache").addHandler(handler)


def test_memory_store_in_workers_warns_once_per_job(tmp_path: Any, namespace: str) -> None:
    """memory:// is a dict per process: in DataLoader workers nothing is shared, which
    a user must hear once (not once per worker, not once per epoch)."""
    log = tmp_path / "warnings.log"
    dp = ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect("memory://"), namespace=namespace)
    try:
        loader = DataLoader(dp, batch_size=BATCH, num_workers=2, collate_fn=listed,
                            worker_init_fn=_LogTo(str(log)))
        for _ in range(2):  # fresh workers each epoch: four worker processes in all
            assert sorted(epoch(loader)) == list(range(N))
    finally:
        dp.close()
    said = [line for line in log.read_text().splitlines() if "keeps its values in each" in line]
    assert len(said) == 1, said
    assert "lmdb://" in said[0] and "redis://" in said[0]
