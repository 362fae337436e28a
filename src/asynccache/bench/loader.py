"""Warm epochs in the loop users write, against the DataLoader's own limit and diskcache.

The README's loop: ``DataLoader(dp, batch_size=32, shuffle=True, num_workers=2)`` (no
generator, workers started afresh each epoch, the default collate making tensors of the
float32 arrays), ``dp.set_order(loader.batch_sampler)``. Items are float32 arrays of
4 KiB, 100 KiB (4,000 of each) and 1 MiB (640), already in every cache (warm). Cases, timed
round-robin, each with the peak RSS of its workers:

* **the loader's limit**: the same loader over a dataset that costs nothing (it returns
  one prebuilt array): what the workers, their queues and the collate cost alone, the
  most any cache can reach;
* **asynccache, redis**: ``async_kv_cache`` on the run's Redis (TCP loopback);
* **asynccache, lmdb**: the same on ``lmdb://`` in a temporary directory;
* **diskcache**: the wrapper a one-machine user writes without asynccache, a
  ``diskcache.Cache`` in a temporary directory, ``get`` then compute and ``set`` on a
  miss (each worker opens the directory itself).

The goals divide each cache's items/s by the limit's, and asynccache's by diskcache's,
and compare the workers' peak RSS with the limit's (a worker's RSS counts the pages it
shares with the process it was forked from, alike for every case). Nothing here is
asserted on timings.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.util
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import diskcache

import asynccache as ac

from ._common import BenchError, Session, Store

SIZES = (4 * 1024, 100 * 1024, 1024 * 1024)
ITEMS = (4_000, 2_000, 256)  # full, quick, smoke
BYTES = (640 << 20, 256 << 20, 64 << 20)  # caps the items of large values
REPS = (5, 3, 1)
BATCH, WORKERS = 32, 2
LIMIT, REDIS, LMDB, DISKCACHE = ("the loader's limit", "asynccache, redis",
                                 "asynccache, lmdb", "diskcache")
CASES = (LIMIT, REDIS, LMDB, DISKCACHE)


class Values:
    """``n`` float32 arrays of ``size`` bytes, item ``i`` filled with ``i % 251``."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        import numpy as np

        if not 0 <= index < self.n:
            raise IndexError(index)
        return np.full(self.size // 4, index % 251, dtype=np.float32)


class Free(Values):
    """Costs nothing: every item is the same prebuilt array (the loader's own limit)."""

    def __init__(self, n: int, size: int) -> None:
        super().__init__(n, size)
        self.value = super().__getitem__(0)

    def __getitem__(self, index: int) -> Any:
        return self.value


class DiskCached:
    """What a one-machine user writes: a dataset that looks in a ``diskcache.Cache``
    first and fills it on a miss. The cache is opened in each process that reads (a
    SQLite connection does not survive a fork)."""

    def __init__(self, source: Values, directory: str) -> None:
        self.source, self.directory = source, directory
        self._cache: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        if self._pid != os.getpid():
            self._cache, self._pid = diskcache.Cache(self.directory), os.getpid()
        value = self._cache.get(index)
        if value is None:
            value = self.source[index]
            self._cache.set(index, value)
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None, "_pid": -1}


def _report_peak(slots: Any, worker_id: int) -> None:
    """``worker_init_fn``: when the worker exits, its peak RSS (KiB) into
    ``slots[worker_id]`` (it changes nothing the loop does)."""
    def report() -> None:
        slots[worker_id] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    multiprocessing.util.Finalize(None, report, exitpriority=100)


def _epoch(dataset: Any) -> tuple[float, int]:
    """One epoch of the README's loop, fresh workers: (seconds, the largest peak RSS of
    a worker in KiB; it counts the pages a worker shares with the process it was forked
    from, alike for every case of a run)."""
    from torch.utils.data import DataLoader

    slots = multiprocessing.Array("q", WORKERS, lock=False)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                        worker_init_fn=functools.partial(_report_peak, slots))
    if isinstance(dataset, ac.AsyncKVCacheMapDataPipe):
        assert loader.batch_sampler is not None
        dataset.set_order(loader.batch_sampler)
    started = time.perf_counter()
    got = sum(len(batch) for batch in loader)
    seconds = time.perf_counter() - started
    del loader  # its workers have exited (the iterator shut them down when it ended)
    if got != len(dataset):
        raise BenchError(f"an epoch read {got} of {len(dataset)} items")
    return seconds, max(slots)


def _pipes(s: Session, store: Store, root: str, source: Values
           ) -> dict[str, ac.AsyncKVCacheMapDataPipe]:
    size, n = source.size, len(source)
    map_size = max(64 << 20, int(n * (size + 1024) * 2))
    return {
        REDIS: ac.AsyncKVCacheMapDataPipe(source, ac.connect(store.url, timeout=10),
                                          namespace=s.namespace("loader", size),
                                          ttl=s.ttl(store)),
        LMDB: ac.AsyncKVCacheMapDataPipe(
            source, ac.connect(f"lmdb://{root}/lmdb-{size}?map_size={map_size}&sync=false"),
            namespace=s.namespace("loader", size)),
    }


def _fill(s: Session, store: Store, root: str, source: Values, disk: DiskCached) -> None:
    """Every value into every cache, in this process (the epochs are warm)."""
    for pipe in _pipes(s, store, root, source).values():
        with pipe:
            for start in range(0, len(source), 256):
                pipe.__getitems__(list(range(start, min(len(source), start + 256))))
    for i in range(len(source)):
        disk[i]
    disk._cache.close()


def _size(s: Session, store: Store, root: str, n: int, size: int, reps: int
          ) -> dict[str, Any]:
    source = Values(n, size)
    disk = DiskCached(source, f"{root}/diskcache-{size}")
    _fill(s, store, root, source, disk)
    disk = DiskCached(source, disk.directory)  # closed in this process: workers open it
    pipes = _pipes(s, store, root, source)
    datasets: dict[str, Any] = {LIMIT: Free(n, size), **pipes, DISKCACHE: disk}
    times: dict[str, list[float]] = {case: [] for case in CASES}
    peaks: dict[str, list[int]] = {case: [] for case in CASES}
    try:
        for rep in range(reps + 1):  # rep 0: warm-up
            for case in CASES:
                seconds, peak = _epoch(datasets[case])
                if rep:
                    times[case].append(seconds)
                    peaks[case].append(peak)
        computed = {case: pipe.stats()["computed"] for case, pipe in pipes.items()}
    finally:
        for pipe in pipes.values():
            pipe.close()
    if any(computed.values()):
        raise BenchError(f"warm epochs computed items: {computed}")
    cases = {case: {"epoch_s": statistics.median(t), "items_per_s": n / statistics.median(t),
                    "worker_peak_rss_mib": statistics.median(peaks[case]) / 1024}
             for case, t in times.items()}
    limit = cases[LIMIT]["items_per_s"]
    return {
        "value_bytes": size,
        "items": n,
        "cases": cases,
        "ratio_vs_limit": {case: cases[case]["items_per_s"] / limit
                           for case in (REDIS, LMDB, DISKCACHE)},
        "ratio_vs_diskcache": {case: cases[case]["items_per_s"]
                               / cases[DISKCACHE]["items_per_s"] for case in (REDIS, LMDB)},
        "rss_vs_limit": {case: cases[case]["worker_peak_rss_mib"]
                         / cases[LIMIT]["worker_peak_rss_mib"]
                         for case in (REDIS, LMDB, DISKCACHE)},
    }


def run(s: Session, store: Store) -> dict[str, Any]:
    """Every size, on ``store`` (the run's Redis) and local LMDB and diskcache."""
    mode = s.mode_index
    reps = min(REPS[mode], s.reps)
    root = tempfile.mkdtemp(prefix="asynccache-bench-loader-")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "This DataLoader will create")
            by_size = [_size(s, store, root, min(ITEMS[mode], BYTES[mode] // size), size,
                             reps) for size in SIZES]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"reps": reps, "workers": WORKERS, "batch": BATCH, "by_size": by_size}
