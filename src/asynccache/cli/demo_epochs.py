"""The work of ``asynccache demo`` (its command line is `asynccache.cli.demo`): what a
shared cache buys a DataLoader with non-persistent workers.

A synthetic image dataset whose ``__getitem__`` costs real CPU (generate a 3x256x256
"decoded JPEG" from the index, convert colours, resize to 3x96x96, sharpen) is read
for a cold and a warm epoch in three configurations:

- no cache: every epoch computes every item;
- a per-worker dict (what ``InMemoryCacheHolder`` does): each worker process fills its
  own copy, and non-persistent workers start empty again, so the warm epoch computes
  everything once more and each worker's memory grows with the items it saw;
- ``async_kv_cache`` on a private Redis-compatible server (or ``--url``): the cold epoch
  fills the store, the warm epoch reads every item from it.

The table counts calls of ``__getitem__`` on the source across all worker processes
(shared memory), the time and throughput of each epoch, and the peak RSS of each worker
(sampled from the parent with psutil, which works with every start method). A checksum
of every epoch's pixels and labels must match, so a cache that returned wrong values
fails the demo.

This module imports torch, numpy and psutil (the ``demo`` extra); `asynccache.cli.demo`
imports it only when the demo runs, so ``asynccache demo --help`` works without them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ..readahead.datapipe import AsyncKVCacheMapDataPipe
from ..store.connect import connect
from ..testing import servers
from .progress import Progress

__all__ = ["InMemoryCache", "SyntheticImages", "decode", "run_demo"]

RAW_SIZE = 256
OUT_SIZE = 96
NO_CACHE, DICT_CACHE, ASYNC_CACHE = "no cache", "dict per worker", "async_kv_cache"
COLD, WARM = "cold", "warm"
MIB = 1 << 20

# JPEG's YCbCr -> RGB matrix, and a 3x3 binomial blur for an unsharp mask.
_YCBCR_TO_RGB = torch.tensor(
    [[1.0, 0.0, 1.402], [1.0, -0.344136, -0.714136], [1.0, 1.772, 0.0]], dtype=torch.float32
)
_BLUR = (torch.tensor([1.0, 2.0, 1.0]).outer(torch.tensor([1.0, 2.0, 1.0])) / 16).view(1, 1, 3, 3)


# ------------------------------------------------------------------------------- dataset


def decode(index: int) -> dict[str, Any]:
    """The expensive part: a deterministic image for ``index``, "decoded" and resized."""
    rng = np.random.default_rng(index)
    raw = torch.from_numpy(rng.integers(0, 256, size=(3, RAW_SIZE, RAW_SIZE), dtype=np.uint8))
    ycbcr = raw.view(3, -1).to(torch.float32)
    ycbcr[1:] -= 128.0
    rgb = (_YCBCR_TO_RGB @ ycbcr).view(1, 3, RAW_SIZE, RAW_SIZE)
    small = F.interpolate(
        rgb, size=(OUT_SIZE, OUT_SIZE), mode="bicubic", antialias=True, align_corners=False
    ).view(3, 1, OUT_SIZE, OUT_SIZE)
    sharp = 2 * small - F.conv2d(small, _BLUR, padding=1)
    image = sharp.clamp_(0, 255).round_().to(torch.uint8).view(3, OUT_SIZE, OUT_SIZE)
    return {"image": image, "label": int(rng.integers(10))}


# The call counter of this worker process, installed by _init_worker. It is not an
# attribute of the dataset: torch pickles a datapipe's whole graph in every worker
# (sharding), and a multiprocessing Value refuses to be pickled outside process start.
_calls: Any = None


class SyntheticImages(Dataset):
    """``n`` items made by `decode`; calls in DataLoader workers are counted."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        calls = _calls
        if calls is not None:
            with calls.get_lock():
                calls.value += 1
        return decode(index)


class InMemoryCache(Dataset):
    """A dict filled on miss, like ``InMemoryCacheHolder``: one private copy per process."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.cache: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.cache[index]
        except KeyError:
            value = self.cache[index] = self.source[index]
            return value


def measure_item_cost(rounds: int = 5, per_round: int = 10) -> float:
    """Seconds per `decode` call with one torch thread, as in a DataLoader worker.

    The median of a few rounds, so a neighbour's burst of CPU does not set the figure.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decode(0)  # first-call setup
        costs = []
        for r in range(rounds):
            start = time.perf_counter()
            for index in range(r * per_round, (r + 1) * per_round):
                decode(index)
            costs.append((time.perf_counter() - start) / per_round)
        return statistics.median(costs)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------- measurement


def _init_worker(calls: Any, pids: Any, worker_id: int) -> None:
    """``worker_init_fn``: count source calls here; publish the pid for the RSS sampler."""
    global _calls
    _calls = calls
    pids[worker_id] = os.getpid()


class _RssSampler:
    """Peak RSS of each DataLoader worker, sampled from the parent with psutil.

    Sampling from outside needs nothing from the workers but their pid, so it works with
    fork, spawn and forkserver alike, and a worker's last moments are not lost to an
    exit path that skips its own reporting.
    """

    def __init__(self, pids: Any, interval: float = 0.02) -> None:
        self.pids = pids
        self.interval = interval
        self.peak = [0] * len(pids)
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asynccache-demo-rss", daemon=True)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        for slot, pid in enumerate(self.pids[:]):
            if not pid:
                continue
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                rss = proc.memory_info().rss
            except psutil.Error:  # not started yet, or already gone
                continue
            self.peak[slot] = max(self.peak[slot], rss)


@dataclass
class EpochResult:
    config: str
    epoch: str
    seconds: float
    items: int
    computed: int
    hit_rate: float | None  # None: no cache
    peak_rss_mib: list[float]  # one per worker
    checksum: int

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else float("inf")


def _checksum(batch: dict[str, torch.Tensor]) -> int:
    # numpy sums uint8 into int64 through a small buffer; torch's sum(dtype=torch.int64)
    # made the parent's heap grow ~80 MiB per epoch here, which fork hands to every worker.
    return int(batch["image"].numpy().sum(dtype=np.int64)) * 31 + int(batch["label"].sum())


def run_epoch(
    dataset: Any,
    calls: Any,
    pids: Any,
    args: argparse.Namespace,
    ctx: BaseContext,
    config: str,
    epoch: str,
    seed: int,
    progress: Progress | None = None,
) -> EpochResult:
    """One pass with fresh worker processes; counters are reset first."""
    with calls.get_lock():
        calls.value = 0
    pids[:] = [0] * len(pids)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=False,
        multiprocessing_context=ctx,
        worker_init_fn=functools.partial(_init_worker, calls, pids),
        generator=torch.Generator().manual_seed(seed),
    )
    if progress is not None:
        progress.describe(f"demo: {config}, {epoch} epoch")
    seconds, checksum, peaks = timed_pass(loader, pids, progress)
    computed = int(calls.value)
    items = len(dataset)
    return EpochResult(
        config=config,
        epoch=epoch,
        seconds=seconds,
        items=items,
        computed=computed,
        hit_rate=None if config == NO_CACHE else (items - computed) / items,
        peak_rss_mib=[round(peak / MIB, 1) for peak in peaks],
        checksum=checksum,
    )


def timed_pass(
    loader: DataLoader, pids: Any, progress: Progress | None = None
) -> tuple[float, int, list[int]]:
    """One pass over ``loader``: (seconds, checksum, peak RSS in bytes of each worker).

    Items read are counted on ``progress``; worker RSS is sampled from this process
    while the pass runs.
    """
    checksum = 0
    start = time.perf_counter()
    batches = iter(loader)  # starts the workers: no thread of ours exists during the fork
    with _RssSampler(pids) as rss:
        for batch in batches:
            checksum += _checksum(batch)
            if progress is not None:
                progress.update(len(batch["label"]))
    return time.perf_counter() - start, checksum, list(rss.peak)


# ------------------------------------------------------------------------------ output


def _percent(rate: float | None) -> str:
    if rate is None:
        return "-"
    if rate in (0.0, 1.0):
        return f"{rate:.0%}"
    return f"{int(rate * 1000) / 10:.1f}%"  # truncated: 1999 of 2000 is not "100%"


def format_table(results: Sequence[EpochResult]) -> str:
    header = (
        "configuration",
        "epoch",
        "seconds",
        "items/s",
        "computed",
        "hit rate",
        "peak RSS/worker",
    )
    rows = [header] + [
        (
            r.config,
            r.epoch,
            f"{r.seconds:.2f}",
            f"{r.items_per_s:,.0f}",
            f"{r.computed}/{r.items}",
            _percent(r.hit_rate),
            f"{max(r.peak_rss_mib):.0f} MiB" if any(r.peak_rss_mib) else "?",
        )
        for r in results
    ]
    widths = [max(len(row[col]) for row in rows) for col in range(len(header))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if col < 2 else cell.rjust(width)
            for col, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _find(results: Sequence[EpochResult], config: str, epoch: str) -> EpochResult:
    return next(r for r in results if r.config == config and r.epoch == epoch)


def summary(results: Sequence[EpochResult]) -> dict[str, float]:
    cold = _find(results, ASYNC_CACHE, COLD)
    warm = _find(results, ASYNC_CACHE, WARM)
    plain = _find(results, NO_CACHE, WARM)
    return {
        "async_kv_cache_warm_over_cold": warm.seconds / cold.seconds,
        "async_kv_cache_speedup_vs_no_cache": plain.seconds / warm.seconds,
    }


# ------------------------------------------------------------------------------- command


@contextlib.contextmanager
def _store(args: argparse.Namespace) -> Iterator[servers.RedisServer | None]:
    """Our private server (stopped on any exit, Ctrl-C included), or None with --url."""
    if args.url:
        yield None
        return
    prefer = None if args.server == "auto" else args.server
    with servers.start_redis(prefer=prefer) as server:
        yield server


def _store_usage(server: servers.RedisServer | None) -> str:
    if server is None:
        return ""
    keys = server.call("DBSIZE")
    info = server.call("INFO", "memory").decode(errors="replace")
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    used = fields.get("used_memory_human", "?").strip()
    return f"store now holds {keys} keys, {used} used"


def run_demo(
    args: argparse.Namespace, items: int, progress: Progress, ttl: float | None
) -> tuple[dict[str, Any], str]:
    """The demo: (the JSON document, the report as text), its values written with
    ``ttl``. Lines about what it is doing go out as it goes, through ``progress``
    (stderr with ``--json``, else stdout)."""
    out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        progress.write(line, file=out)

    ctx = multiprocessing.get_context(args.start_method)
    calls = ctx.Value("q", 0)
    pids = ctx.Array("q", args.workers)
    source = SyntheticImages(items)

    progress.describe("demo: timing __getitem__")
    cost = measure_item_cost()
    say(
        f"dataset: {items} synthetic images, 3x{RAW_SIZE}x{RAW_SIZE} -> 3x{OUT_SIZE}x{OUT_SIZE} "
        f"uint8; __getitem__ costs {cost * 1e3:.2f} ms per item (one thread)"
    )
    say(
        f"loader: {args.workers} workers ({ctx.get_start_method()}, non-persistent), "
        f"batch size {args.batch_size}, shuffle"
    )
    results: list[EpochResult] = []
    progress.describe("demo: starting a server" if not args.url else "demo: connecting")
    with _store(args) as server:
        client = connect(args.url if server is None else server.url)
        description = (
            f"existing store {client.safe_url} (nothing started)"
            if server is None
            else f"private {server.kind} {server.version} at {server.url}"
        )
        say(f"store: {description}")
        namespace = f"demo-{uuid.uuid4().hex[:12]}"
        cached = AsyncKVCacheMapDataPipe(
            source, client, prefetch=args.prefetch, namespace=namespace, ttl=ttl
        )
        configs = {NO_CACHE: source, DICT_CACHE: InMemoryCache(source), ASYNC_CACHE: cached}
        for config, dataset in configs.items():
            for offset, epoch in enumerate((COLD, WARM)):
                result = run_epoch(
                    dataset, calls, pids, args, ctx, config, epoch, args.seed + offset, progress
                )
                results.append(result)
                progress.write(
                    f"  {config:<15} {epoch}: {result.seconds:6.2f} s, {result.computed} computed",
                    file=sys.stderr,
                )
        cached.close()
        usage = _store_usage(server)

    ratios = summary(results)
    warm, cold = _find(results, ASYNC_CACHE, WARM), _find(results, ASYNC_CACHE, COLD)
    report = [
        "",
        format_table(results),
        "",
        f"async_kv_cache: warm/cold = {warm.seconds:.2f} s / {cold.seconds:.2f} s = "
        f"{ratios['async_kv_cache_warm_over_cold']:.2f}; warm epoch vs no cache: "
        f"{ratios['async_kv_cache_speedup_vs_no_cache']:.1f}x speed-up",
    ]
    if usage:
        report.append(f"{usage} (namespace {namespace})")
    mismatched = [r for r in results if r.checksum != results[0].checksum]
    errors = [
        f"{r.config} {r.epoch} epoch returned different data than {results[0].config} "
        f"{results[0].epoch} (checksum {r.checksum} != {results[0].checksum})"
        for r in mismatched
    ]
    document = {
        "items": items,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "start_method": ctx.get_start_method(),
        "store": description,
        "namespace": namespace,
        "item_cost_ms": cost * 1e3,
        "results": [asdict(r) | {"items_per_s": r.items_per_s} for r in results],
        "summary": ratios,
        "data_ok": not mismatched,
        "errors": errors,
    }
    return document, "\n".join(report)
