"""One machine, no network: LMDB (``lmdb://``) against Redis on a unix socket.

Both are stores for "every DataLoader worker of one machine shares the cache". LMDB
has no server: a hit is a read transaction on a memory map, done in the consumer's own
thread; Redis on a unix socket costs a round trip to another process and protocol
parsing, but evicts and can be reached from other machines. Measured warm, with the
values written once beforehand, at 4 KiB and 256 KiB per value:

* **DataLoader**: items/s of a warm shuffled epoch through a torch ``DataLoader`` with
  2 workers (``fork``, persistent workers, batches of 32, the pipe following the
  sampler's order), median over the timed epochs after a warm-up epoch;
* **in process**: items/s of ``dp[i]`` over a shuffled order given as ``order=``.

Every case of one size runs on the same values; the ratio is LMDB over Redis in the
same run. Nothing here is asserted on timings.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

import asynccache as ac

from ..testing import servers
from . import plots
from ._common import (
    BenchError,
    Session,
    fmt_rate,
    fmt_size,
    markdown_table,
    progress_bar,
    quiet_gc,
    session_for,
)

SIZES = (4096, 256 * 1024)
ITEMS = (4096, 1024, 96)            # full, quick, smoke (at 4 KiB)
BYTES_PER_SIZE = (256 << 20, 64 << 20, 4 << 20)  # caps the item count of large values
BATCH = 32
WORKERS = 2


class _Values(torch.utils.data.Dataset):
    """``size`` bytes per item (bytes, not tensors: no shared-memory segment per item)."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"i": index, "x": bytes([index % 251]) * self.size}


def _listed(batch: list[Any]) -> list[Any]:
    return batch


def _items_for(size: int, mode: int) -> int:
    return max(BATCH * WORKERS, min(ITEMS[mode], BYTES_PER_SIZE[mode] // size))


def _dataloader(url: str, namespace: str, n: int, size: int, reps: int) -> float:
    """Warm shuffled epochs with persistent fork workers: items/s (median)."""
    dp = ac.AsyncKVCacheMapDataPipe(_Values(n, size), ac.connect(url, timeout=10),
                                    namespace=namespace)
    loader = DataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                        generator=torch.Generator().manual_seed(0), collate_fn=_listed,
                        persistent_workers=True, multiprocessing_context="fork")
    assert loader.batch_sampler is not None
    dp.set_order(loader.batch_sampler)
    times = []
    try:
        for epoch in range(reps + 1):
            started = time.perf_counter()
            got = sum(len(batch) for batch in loader)
            seconds = time.perf_counter() - started
            if got != n:
                raise BenchError(f"a warm epoch read {got} of {n} items")
            if epoch:
                times.append(seconds)
    finally:
        del loader
        stats = dp.stats()
        dp.close()
    if stats["computed"]:
        raise BenchError(f"{stats['computed']} items were computed in warm epochs")
    return n / statistics.median(times)


def _in_process(url: str, namespace: str, n: int, size: int, reps: int) -> float:
    """``dp[i]`` over a shuffled order known in advance: items/s (median)."""
    times = []
    for rep in range(reps + 1):
        order = list(RandomSampler(range(n), generator=torch.Generator().manual_seed(rep)))
        with ac.AsyncKVCacheMapDataPipe(_Values(n, size), ac.connect(url), order=order,
                                        namespace=namespace) as dp:
            started = time.perf_counter()
            for i in order:
                dp[i]
            seconds = time.perf_counter() - started
            if dp.stats()["misses"]:
                raise BenchError("an in-process warm pass missed")
        if rep:
            times.append(seconds)
    return n / statistics.median(times)


def run(*, quick: bool, out_dir: Path, progress: bool,
        session: Session | None = None) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc(), \
            servers.start_redis(unix_socket=True) as redis:
        mode = s.mode_index
        reps = max(1, min(s.reps, 3))
        root = tempfile.mkdtemp(prefix="asynccache-bench-lmdb-")
        results: dict[str, Any] = {
            "config": {"sizes": list(SIZES), "workers": WORKERS, "batch": BATCH, "reps": reps,
                       "redis": f"{redis.kind} {redis.version} on a unix socket",
                       "lmdb_dir": root},
            "by_size": [],
        }
        bar = progress_bar(len(SIZES) * 4, "local", s.progress)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "This DataLoader will create")
                for size in SIZES:
                    n = _items_for(size, mode)
                    map_size = max(64 << 20, int(n * (size + 1024) * 1.5))
                    urls = {"lmdb": f"lmdb://{root}/{size}?map_size={map_size}&sync=false",
                            "redis-unix": redis.url}
                    block: dict[str, Any] = {"value_bytes": size, "items": n, "cases": {}}
                    for name, url in urls.items():
                        bar.describe(f"local {fmt_size(size)} {name}")
                        namespace = s.namespace("local", name, size)
                        with ac.AsyncKVCacheMapDataPipe(_Values(n, size), ac.connect(url),
                                                        namespace=namespace) as fill:
                            for start in range(0, n, 256):
                                fill.__getitems__(list(range(start, min(n, start + 256))))
                        loader_rate = _dataloader(url, namespace, n, size, reps)
                        bar.update()
                        block["cases"][name] = {
                            "dataloader_items_per_s": loader_rate,
                            "dp_items_per_s": _in_process(url, namespace, n, size, reps),
                        }
                        bar.update()
                    lm, rd = block["cases"]["lmdb"], block["cases"]["redis-unix"]
                    block["ratio_lmdb_vs_redis"] = {
                        "dataloader": lm["dataloader_items_per_s"] / rd["dataloader_items_per_s"],
                        "dp": lm["dp_items_per_s"] / rd["dp_items_per_s"],
                    }
                    results["by_size"].append(block)
        finally:
            bar.close()
            shutil.rmtree(root, ignore_errors=True)
    return results


def table(results: dict[str, Any]) -> str:
    c = results["config"]
    out = [f"### One machine: LMDB against {c['redis']}, warm, median of {c['reps']}\n"]
    rows = []
    for block in results["by_size"]:
        cases, ratio = block["cases"], block["ratio_lmdb_vs_redis"]
        rows.append([
            fmt_size(block["value_bytes"]), f"{block['items']:,}",
            fmt_rate(cases["lmdb"]["dataloader_items_per_s"]),
            fmt_rate(cases["redis-unix"]["dataloader_items_per_s"]),
            f"{ratio['dataloader']:.2f}x",
            fmt_rate(cases["lmdb"]["dp_items_per_s"]),
            fmt_rate(cases["redis-unix"]["dp_items_per_s"]),
            f"{ratio['dp']:.2f}x",
        ])
    out.append(markdown_table(
        ["value", "items", f"DataLoader {c['workers']} workers, LMDB", "…, Redis unix",
         "LMDB / Redis", "dp[i] in process, LMDB", "…, Redis unix", "LMDB / Redis"], rows))
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    groups = {}
    for block in results["by_size"]:
        for case in ("dataloader", "dp"):
            groups[f"{fmt_size(block['value_bytes'])} {case}"] = {
                name: values[f"{case}_items_per_s"] for name, values in block["cases"].items()}
    return [plots.bars(out_dir / "local_items_per_s.png", groups,
                       title="LMDB vs Redis on a unix socket, warm (items/s, higher is better)",
                       xlabel="items/s", reference=None)]
