"""A near/far tier (``ac.Tiered(near, far)``) against the far store alone, far away.

The far store (the run's Redis) sits behind the loopback latency proxy of
`asynccache.bench.network` at +0.2 ms (a rack) and +1 ms (a data centre); the near
store is LMDB in a temporary directory of this machine. Cases, each a warm shuffled
epoch through a torch ``DataLoader`` (2 ``fork`` workers, batches of 32, the pipe
following the sampler), 4 KiB values already in far:

* **far alone**: the pipe on the far store;
* **tiered, warm from near**: ``Tiered(lmdb, far)`` with near already holding every
  value (nothing reaches far);
* **tiered, near empty**: the same with an empty near each epoch: every read goes on to
  far and its hits are copied into near (what the first epoch on a new machine costs);
* **near alone**: the pipe on the LMDB directory, no far at all (the floor).

Each epoch builds its pipe and loader afresh (workers forked per epoch, alike for every
case); the cases are timed round-robin after one warm-up round; figures are medians.
Nothing here is asserted on timings.
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
from torch.utils.data import DataLoader

import asynccache as ac

from . import plots
from ._common import (
    BenchError,
    Session,
    fmt_rate,
    fmt_ratio,
    markdown_table,
    progress_bar,
    quiet_gc,
    session_for,
)
from .network import ProxyProcess, ping_us

RTTS = ((0.2e-3, 1e-3), (0.2e-3, 1e-3), (1e-3,))  # full, quick, smoke
ITEMS = (4096, 2048, 128)
SIZE = 4096
BATCH = 32
WORKERS = 2
CASES = ("far alone", "tiered, warm from near", "tiered, near empty", "near alone")


class _Values(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"i": index, "x": bytes([index % 251]) * SIZE}


def _listed(batch: list[Any]) -> list[Any]:
    return batch


def _epoch(client: ac.BaseClient, namespace: str, n: int, seed: int
           ) -> tuple[float, dict[str, int]]:
    """One warm shuffled epoch: (seconds, the pipe's counters)."""
    dp = ac.AsyncKVCacheMapDataPipe(_Values(n), client, namespace=namespace)
    loader = DataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                        generator=torch.Generator().manual_seed(seed), collate_fn=_listed,
                        multiprocessing_context="fork")
    assert loader.batch_sampler is not None
    dp.set_order(loader.batch_sampler)
    try:
        started = time.perf_counter()
        got = sum(len(batch) for batch in loader)
        seconds = time.perf_counter() - started
    finally:
        del loader
        dp.close()
    if got != n:
        raise BenchError(f"an epoch read {got} of {n} items")
    return seconds, dp.stats()


def _fill(client: ac.BaseClient, namespace: str, n: int) -> None:
    with ac.AsyncKVCacheMapDataPipe(_Values(n), client, namespace=namespace) as dp:
        for start in range(0, n, 256):
            dp.__getitems__(list(range(start, min(n, start + 256))))


def run(*, quick: bool, out_dir: Path, progress: bool,
        session: Session | None = None) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc():
        store = s.redis_store()
        if store is None:
            raise BenchError("the tiered benchmark needs a Redis (or Valkey) as its far store")
        mode = s.mode_index
        n = ITEMS[mode]
        reps = max(1, min(s.reps, 3 if mode == 2 else s.reps))
        root = tempfile.mkdtemp(prefix="asynccache-bench-tiered-")
        map_size = max(64 << 20, int(n * (SIZE + 1024) * 2))
        results: dict[str, Any] = {
            "config": {"items": n, "value_bytes": SIZE, "workers": WORKERS, "batch": BATCH,
                       "reps": reps, "rtts_s": list(RTTS[mode]), "far": store.label,
                       "near": "lmdb (sync=false) in a temporary directory"},
            "levels": [],
        }
        bar = progress_bar(len(RTTS[mode]) * len(CASES) * (reps + 1), "tiered", s.progress)
        try:
            with ProxyProcess() as proxies, warnings.catch_warnings():
                warnings.filterwarnings("ignore", "This DataLoader will create")
                port = proxies.proxy_for(store)
                far_store = store.at("127.0.0.1", port)
                namespace = s.namespace("tiered")
                near_url = f"lmdb://{root}/warm?map_size={map_size}&sync=false"
                _fill(ac.connect(store.url, timeout=10), namespace, n)
                _fill(ac.connect(near_url), namespace, n)
                for rtt in RTTS[mode]:
                    proxies.set_latency(port, rtt)
                    results["levels"].append(_level(far_store.url, near_url, root, map_size,
                                                    namespace, n, reps, rtt,
                                                    ping_us(far_store), bar))
                proxies.set_latency(port, 0.0)
        finally:
            bar.close()
            shutil.rmtree(root, ignore_errors=True)
    return results


def _level(far_url: str, near_url: str, root: str, map_size: int, namespace: str, n: int,
           reps: int, rtt: float, measured_us: float, bar: Any) -> dict[str, Any]:
    far = ac.connect(far_url, timeout=10)
    times: dict[str, list[float]] = {case: [] for case in CASES}
    copies: list[int] = []
    for rep in range(reps + 1):  # rep 0: warm-up
        for case in CASES:
            if case == "far alone":
                client: ac.BaseClient = far
            elif case == "tiered, warm from near":
                client = ac.Tiered(ac.connect(near_url), far)
            elif case == "tiered, near empty":
                empty = f"lmdb://{root}/empty-{rtt:g}-{rep}?map_size={map_size}&sync=false"
                client = ac.Tiered(ac.connect(empty), far)
            else:
                client = ac.connect(near_url)
            seconds, stats = _epoch(client, namespace, n, seed=rep)
            if stats["computed"]:
                raise BenchError(f"{case}: {stats['computed']} items computed in a warm epoch")
            if case == "tiered, warm from near" and stats.get("tier_far_hits"):
                raise BenchError("tiered, warm from near: far was read")
            if case == "tiered, near empty":
                copies.append(stats.get("tier_copies", 0))
            if rep:
                times[case].append(seconds)
            bar.update()
    cases = {case: {"epoch_s": statistics.median(t), "items_per_s": n / statistics.median(t)}
             for case, t in times.items()}
    far_s = cases["far alone"]["epoch_s"]
    return {
        "rtt_added_s": rtt,
        "ping_us": measured_us,
        "cases": cases,
        "copied_per_empty_epoch": copies,
        "ratio_far_vs_tiered_warm": far_s / cases["tiered, warm from near"]["epoch_s"],
        "ratio_far_vs_tiered_empty": far_s / cases["tiered, near empty"]["epoch_s"],
        "ratio_far_vs_near_alone": far_s / cases["near alone"]["epoch_s"],
    }


def table(results: dict[str, Any]) -> str:
    c = results["config"]
    out = [f"### Near/far tier: epoch time, {c['items']:,} items of {c['value_bytes']} B, "
           f"DataLoader {c['workers']} workers, far = {c['far']} behind the latency proxy, "
           f"near = LMDB; median of {c['reps']}\n"]
    rows = []
    for level in results["levels"]:
        cases = level["cases"]
        rows.append([
            f"+{level['rtt_added_s'] * 1e3:g} ms", f"{level['ping_us']:.0f}",
            *(f"{cases[case]['epoch_s']:.3f}" for case in CASES),
            fmt_ratio(level["ratio_far_vs_tiered_warm"]),
            fmt_ratio(level["ratio_far_vs_tiered_empty"]),
            fmt_rate(cases["tiered, warm from near"]["items_per_s"]),
        ])
    out.append(markdown_table(
        ["RTT", "ping µs", *(f"{case} s" for case in CASES), "far ÷ tiered warm",
         "far ÷ tiered empty", "tiered warm items/s"], rows))
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    groups = {f"+{level['rtt_added_s'] * 1e3:g} ms": {
        case: values["epoch_s"] for case, values in level["cases"].items()}
        for level in results["levels"]}
    return [plots.bars(out_dir / "tiered_epoch_s.png", groups,
                       title="Near/far tier: warm epoch time (s, lower is better)",
                       xlabel="seconds per epoch", reference=None)]
