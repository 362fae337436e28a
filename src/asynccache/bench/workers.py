"""Warm shuffled DataLoader epochs with workers: read-ahead that follows the sampler.

A DataLoader hands batches to its workers round-robin; without knowing the order, a
worker's pipe sees each batch only when it arrives and reads it with one blocking
multi-get (a round trip per batch, in every worker). With ``dp.set_order(
loader.batch_sampler)`` (a seeded sampler) each worker plans the batches that will come
to it and reads them ahead. Measured here, on the run's first Redis-protocol store,
directly and through the loopback latency proxy at +1 ms round trip, with 2 and 4
workers, ``shuffle=True`` and a seeded generator, the pipe warm:

* **warm epoch** time (median of the timed repetitions), with and without following;
* **hit-before-ask** rate: the share of reads served from the read-ahead buffer
  (``prefetch_hits`` summed over the workers by ``stats()``) — values that were there
  before the worker asked.

Also, on the same data in one process: the node (``CachedMapper`` over a
``SamplerWrapper``, warm) against the pipe read in the same order and against
torchdata's plain ``Mapper`` computing every item (a ~200 µs ``__getitem__``).
"""

from __future__ import annotations

import random
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import asynccache as ac

from . import plots
from ._common import (
    BenchError,
    Session,
    Store,
    fmt_rate,
    markdown_table,
    progress_bar,
    quiet_gc,
    session_for,
)
from .network import ProxyProcess, ping_us

ITEMS = (4096, 2048, 256)  # full, quick, smoke
VALUE_BYTES = 4096
BATCH = 32
WORKERS = (2, 4)
RTTS = ((0.0, 1e-3), (0.0, 1e-3), (1e-3,))
COMPUTE_S = 200e-6


class _Items(torch.utils.data.Dataset):
    """``VALUE_BYTES`` per item; ``compute`` seconds of GIL-free work when computed."""

    def __init__(self, n: int, compute: float = 0.0) -> None:
        self.n = n
        self.compute = compute

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.compute:
            time.sleep(self.compute)
        # bytes, not a tensor: a tensor crosses from a worker through a shared-memory
        # segment of its own (~100 µs each here), which would hide what is measured
        return {"i": index, "x": bytes([index % 251]) * VALUE_BYTES}


def _listed(batch: list[Any]) -> list[Any]:
    return batch


def _epoch(loader: DataLoader) -> int:
    return sum(len(batch) for batch in loader)


def _settled(dp: ac.AsyncKVCacheMapDataPipe, want: int) -> dict[str, int]:
    """The pipe's stats once every worker's final report is in (bounded)."""
    deadline = time.monotonic() + 5
    while True:
        stats = dp.stats()
        reads = stats["hits"] + stats["misses"] + stats["recalled"]
        if reads >= want or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _dataloader_case(url: str, namespace: str, n: int, workers: int, follow: bool,
                     reps: int) -> dict[str, Any]:
    """Persistent workers, so that each timed epoch is an epoch and not a start-up: the
    first epoch is a warm-up, the next ``reps`` are timed (a new permutation each)."""
    dp = ac.AsyncKVCacheMapDataPipe(_Items(n), ac.connect(url), namespace=namespace)
    loader = DataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(0), collate_fn=_listed,
                        persistent_workers=True, multiprocessing_context="fork")
    if follow:
        assert loader.batch_sampler is not None
        dp.set_order(loader.batch_sampler)
    times, rates = [], []
    before = {"prefetch_hits": 0, "hits": 0, "misses": 0}
    try:
        for epoch in range(reps + 1):
            started = time.perf_counter()
            got = _epoch(loader)
            seconds = time.perf_counter() - started
            stats = _settled(dp, (epoch + 1) * n)
            if got != n or stats["misses"]:
                raise BenchError(f"warm epoch read {got} items with {stats['misses']} misses")
            if epoch:
                times.append(seconds)
                rates.append((stats["prefetch_hits"] - before["prefetch_hits"]) / n)
            before = stats
    finally:
        del loader
        dp.close()
    return {"epoch_s": statistics.median(times), "hit_before_ask": statistics.median(rates),
            "epoch_s_all": times}


class OwnRandomSampler(Sampler[int]):
    """A sampler with a random generator of its own (Python's): no copy of it draws what
    the main process draws, so read-ahead cannot follow it (the bench and the tests)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        indices = list(range(self.n))
        random.shuffle(indices)
        return iter(indices)


#: The loop users write, per sampler torch ships (none seeded), and one that cannot be
#: followed: what ``DataLoader`` is given besides the pipe.
SAMPLERS: dict[str, Callable[[int], dict[str, Any]]] = {
    "shuffle=True": lambda n: {"shuffle": True},
    "SubsetRandomSampler": lambda n: {"sampler": SubsetRandomSampler(range(0, n, 2))},
    "WeightedRandomSampler": lambda n: {
        "sampler": WeightedRandomSampler([1.0 + i % 3 for i in range(n)], n,
                                         replacement=True)},
    "own RNG (not followable)": lambda n: {"sampler": OwnRandomSampler(n)},
}
SAMPLER_EPOCHS = 3  # the first warm epoch starts read-ahead; the next two are measured


def sampler_cases(url: str, namespace: str, n: int, workers: int = 2) -> dict[str, Any]:
    """Per sampler kind and fresh or persistent workers, over warm epochs of the README's
    loop (``dp.set_order(loader.batch_sampler)``, no generator given): the share of reads
    served by read-ahead and of keys read ahead in vain. The store must hold every item."""
    out: dict[str, Any] = {}
    for kind, kwargs in SAMPLERS.items():
        for persistent in (False, True):
            dp = ac.AsyncKVCacheMapDataPipe(_Items(n), ac.connect(url), namespace=namespace)
            try:
                loader = DataLoader(dp, batch_size=BATCH, num_workers=workers,
                                    persistent_workers=persistent, collate_fn=_listed,
                                    multiprocessing_context="fork", **kwargs(n))
                assert loader.batch_sampler is not None
                dp.set_order(loader.batch_sampler)
                read, first = 0, None
                for epoch in range(SAMPLER_EPOCHS):
                    read += _epoch(loader)
                    stats = _settled(dp, read)
                    if stats["misses"]:
                        raise BenchError(f"{kind}: {stats['misses']} misses in a warm epoch")
                    if epoch == 0:
                        first, first_read = stats, read
            finally:
                dp.close()
            assert first is not None
            reads = read - first_read
            out[f"{kind}, {'persistent' if persistent else 'fresh'} workers"] = {
                "served": (stats["prefetch_hits"] - first["prefetch_hits"]) / reads,
                "wasted": (stats["prefetch_wasted"] - first["prefetch_wasted"]) / reads,
                "stopped": stats["readahead_stopped"], "reads": reads}
    return out


def _in_process_cases(url: str, namespace: str, n: int, reps: int) -> dict[str, Any]:
    from torchdata.nodes import (
        Loader,
        Mapper,
        SamplerWrapper,
    )

    from ..readahead.mapper import CachedMapper

    ds = _Items(n, COMPUTE_S)
    client = ac.connect(url)
    out: dict[str, list[float]] = {"CachedMapper (warm)": [], "pipe dp[i], order= (warm)": [],
                                   "Mapper, no cache": []}
    for rep in range(reps + 1):
        sampler = RandomSampler(range(n), generator=torch.Generator().manual_seed(rep))
        order = list(RandomSampler(range(n), generator=torch.Generator().manual_seed(rep)))
        node = CachedMapper(SamplerWrapper(sampler), ds.__getitem__, client,
                            namespace=namespace)
        started = time.perf_counter()
        got = sum(1 for _ in Loader(node))
        node_s = time.perf_counter() - started
        node.close()
        dp = ac.AsyncKVCacheMapDataPipe(ds, client, namespace=namespace, order=order)
        started = time.perf_counter()
        for i in order:
            dp[i]
        pipe_s = time.perf_counter() - started
        dp.close()
        started = time.perf_counter()
        plain = sum(1 for _ in Loader(Mapper(SamplerWrapper(RandomSampler(range(n))),
                                             ds.__getitem__)))
        plain_s = time.perf_counter() - started
        if got != n or plain != n:
            raise BenchError("an in-process pass lost items")
        if rep:
            out["CachedMapper (warm)"].append(node_s)
            out["pipe dp[i], order= (warm)"].append(pipe_s)
            out["Mapper, no cache"].append(plain_s)
    return {name: {"items_per_s": n / statistics.median(ts)} for name, ts in out.items()}


def run(*, quick: bool, out_dir: Path, progress: bool,
        session: Session | None = None) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc():
        store = s.redis_store()
        if store is None:
            return {"skipped": "needs a Redis-protocol store (redis or valkey)"}
        mode = s.mode_index
        n = ITEMS[mode]
        reps = max(1, min(s.reps, 3))
        namespace = s.namespace("workers", store.name)
        results: dict[str, Any] = {
            "config": {"store": store.name, "server": store.label, "items": n,
                       "value_bytes": VALUE_BYTES, "batch": BATCH, "workers": list(WORKERS),
                       "rtts_s": list(RTTS[mode]), "reps": reps, "compute_s": COMPUTE_S,
                       "shuffle": "RandomSampler with a seeded generator"},
            "levels": [],
        }
        with ac.AsyncKVCacheMapDataPipe(_Items(n), ac.connect(store.url),
                                        namespace=namespace, ttl=s.ttl(store)) as fill:
            fill.__getitems__(list(range(n)))
        bar = progress_bar(len(RTTS[mode]) * len(WORKERS) * 2 + 1, "workers", s.progress)
        try:
            with warnings.catch_warnings(), ProxyProcess() as proxies:
                warnings.filterwarnings("ignore", "This DataLoader will create")
                port = proxies.proxy_for(store)
                proxied: Store = store.at("127.0.0.1", port)
                for rtt in RTTS[mode]:
                    target = store if rtt == 0 else proxied
                    if rtt:
                        proxies.set_latency(port, rtt)
                    level: dict[str, Any] = {"rtt_s": rtt, "ping_us": ping_us(target, 50),
                                             "cases": {}}
                    for workers in WORKERS:
                        for follow in (False, True):
                            name = f"{workers} workers, {'follows' if follow else 'blind'}"
                            bar.describe(f"workers +{rtt * 1e3:g} ms, {name}")
                            level["cases"][name] = _dataloader_case(
                                target.url, namespace, n, workers, follow, reps)
                            bar.update()
                    results["levels"].append(level)
                bar.describe("workers in process")
                results["in_process"] = _in_process_cases(store.url, namespace, n, reps)
                bar.update()
        finally:
            bar.close()
    return results


def table(results: dict[str, Any]) -> str:
    if "skipped" in results:
        return ""
    c = results["config"]
    out = [f"### Warm shuffled DataLoader epochs on {c['server']}: {c['items']:,} x "
           f"{c['value_bytes']} B, batches of {c['batch']}, median of {c['reps']}\n"]
    rows = []
    for level in results["levels"]:
        rtt = f"+{level['rtt_s'] * 1e3:g} ms" if level["rtt_s"] else "loopback"
        cases = level["cases"]
        for workers in c["workers"]:
            blind = cases[f"{workers} workers, blind"]
            follows = cases[f"{workers} workers, follows"]
            rows.append([rtt, f"{level['ping_us']:.0f}", workers,
                         f"{blind['epoch_s'] * 1e3:.0f}", f"{follows['epoch_s'] * 1e3:.0f}",
                         f"{blind['epoch_s'] / follows['epoch_s']:.2f}x",
                         f"{blind['hit_before_ask']:.0%}", f"{follows['hit_before_ask']:.0%}"])
    out.append(markdown_table(
        ["link", "ping µs", "workers", "epoch ms, blind", "epoch ms, follows",
         "speed-up", "hit-before-ask, blind", "hit-before-ask, follows"], rows))
    inproc = results.get("in_process")
    if inproc:
        out.append(f"\nOne process, the same {c['items']:,} items in a shuffled order "
                   f"(a ~{c['compute_s'] * 1e6:.0f} µs `__getitem__` when computed):\n")
        out.append(markdown_table(["reader", "items/s"],
                                  [[k, fmt_rate(v["items_per_s"])] for k, v in inproc.items()]))
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    if "skipped" in results:
        return []
    groups = {}
    for level in results["levels"]:
        rtt = f"+{level['rtt_s'] * 1e3:g} ms" if level["rtt_s"] else "loopback"
        groups[rtt] = {name: case["epoch_s"] * 1e3 for name, case in level["cases"].items()}
    return [plots.bars(out_dir / "workers_epoch_ms.png", groups,
                       title="Warm shuffled DataLoader epoch (ms, lower is better)",
                       xlabel="ms", reference=None)]
