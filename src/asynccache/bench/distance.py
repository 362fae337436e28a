"""The distance table: read-ahead over a store 0.5–5 ms away, against the same proxy at +0.

The run's Redis sits behind the loopback latency proxy of `asynccache.bench.network`
(a child process); for each value size (4 KiB, 1 MiB) and each added round trip, a
pipe with the defaults users run (``prefetch=64``, ``readahead_bytes`` 32 MiB) reads
warm values in order with ``dp[i]``. Reported: items/s and MB/s (medians), the rate ÷
the same proxy at +0 (what the distance costs: the goal is ≥ 0.8), the window the
read-ahead settled on (items, and bytes at the values' size: what was in flight and
ready), and the stalls (reads that waited for read-ahead in flight). Each repetition
builds its pipe afresh, so the window's growth from its first 16 items is in the time.
Nothing here is asserted on timings.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import asynccache as ac

from . import plots
from ._common import (
    BenchError,
    Session,
    fmt_ratio,
    fmt_size,
    markdown_table,
    progress_bar,
    quiet_gc,
    session_for,
)
from .network import ProxyProcess, ping_us

RTTS = ((0.0, 0.5e-3, 2e-3, 5e-3), (0.0, 0.5e-3, 2e-3, 5e-3), (0.0, 2e-3))  # full, quick, smoke
SIZES = (4096, 1 << 20)
#: items read per repetition: (full, quick, smoke) by value size
ITEMS = {4096: (40_000, 20_000, 2_000), 1 << 20: (800, 400, 64)}
PREFETCH = 64


def run(*, quick: bool, out_dir: Path, progress: bool,
        session: Session | None = None) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc():
        store = s.redis_store()
        if store is None:
            raise BenchError("the distance table needs a Redis (or Valkey)")
        mode = s.mode_index
        reps = s.reps if mode < 2 else 1
        results: dict[str, Any] = {
            "config": {"rtts_s": list(RTTS[mode]), "sizes": list(SIZES),
                       "items": {str(k): v[mode] for k, v in ITEMS.items()},
                       "prefetch": PREFETCH, "reps": reps, "store": store.label,
                       "proxy": "asynccache.testing.proxy.FaultProxy in a child process"},
            "levels": [],
        }
        bar = progress_bar(len(SIZES) * len(RTTS[mode]) * reps, "distance", s.progress)
        try:
            with ProxyProcess() as proxies:
                port = proxies.proxy_for(store)
                far = store.at("127.0.0.1", port)
                for size in SIZES:
                    n = ITEMS[size][mode]
                    namespace = s.namespace("distance", size)
                    source = _fill(store.url, namespace, size, n)
                    base = None
                    for rtt in RTTS[mode]:
                        proxies.set_latency(port, rtt)
                        level = _level(far.url, namespace, source, reps, bar)
                        level.update(value_bytes=size, rtt_added_s=rtt, ping_us=ping_us(far))
                        base = base or level["items_per_s"]
                        level["vs_plus_0"] = level["items_per_s"] / base
                        results["levels"].append(level)
                    proxies.set_latency(port, 0.0)
        finally:
            bar.close()
    return results


def _fill(url: str, namespace: str, size: int, n: int) -> list[bytes]:
    """``n`` values of ``size`` bytes (distinct, random), written once."""
    seed = os.urandom(64)
    source = [(seed + i.to_bytes(8, "little")) * (size // 72) + bytes(size % 72)
              for i in range(n)]
    with ac.AsyncKVCacheMapDataPipe(source, ac.connect(url, timeout=10),
                                    namespace=namespace) as pipe:
        step = max(1, (8 << 20) // size)
        for start in range(0, n, step):
            pipe.__getitems__(list(range(start, min(n, start + step))))
            pipe.flush()
    return source


def _level(url: str, namespace: str, source: list[bytes], reps: int,
           bar: Any) -> dict[str, Any]:
    rates, windows, held, stalls = [], [], [], []
    for _ in range(reps):
        with ac.AsyncKVCacheMapDataPipe(source, ac.connect(url, timeout=10),
                                        namespace=namespace, prefetch=PREFETCH) as dp:
            started = time.perf_counter()
            for i in range(len(source)):
                dp[i]
            rates.append(len(source) / (time.perf_counter() - started))
            stats = dp.stats()
            if stats["computed"]:
                raise BenchError(f"{stats['computed']} values computed in a warm pass")
            runtime = dp._rt
            assert runtime is not None
            prefetcher = runtime.local.prefetcher  # what the window became
            windows.append(prefetcher.window)
            held.append(prefetcher.window * max(prefetcher.sizer.item_bytes,
                                                prefetcher.sizer.high_bytes))
            stalls.append(stats["stalls"])
        bar.update()
    rate = statistics.median(rates)
    return {"items_per_s": rate, "mb_per_s": rate * len(source[0]) / 1e6,
            "window_items": statistics.median(windows),
            "window_bytes": statistics.median(held), "stalls": statistics.median(stalls),
            "items": len(source)}


def table(results: dict[str, Any]) -> str:
    c = results["config"]
    out = [f"### Read-ahead over distance: `dp[i]` in order, prefetch={c['prefetch']}, "
           f"through the latency proxy to {c['store']}; median of {c['reps']}\n",
           "÷ +0: the rate over the rate through the same proxy at +0 (goal ≥ 0.8). Window: "
           "where the read-ahead settled, in items and bytes at the values' size.\n"]
    rows = [[fmt_size(level["value_bytes"]), f"+{level['rtt_added_s'] * 1e3:g} ms",
             f"{level['ping_us']:.0f}", f"{level['items_per_s']:,.0f}",
             f"{level['mb_per_s']:,.1f}", fmt_ratio(level["vs_plus_0"]),
             f"{level['window_items']:,.0f}", f"{level['window_bytes'] / 2**20:.1f} MiB",
             f"{level['stalls']:.0f}"]
            for level in results["levels"]]
    out.append(markdown_table(["value", "RTT", "ping µs", "items/s", "MB/s", "÷ +0",
                               "window items", "window bytes", "stalls"], rows))
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    panels = []
    for size in results["config"]["sizes"]:
        levels = [lv for lv in results["levels"] if lv["value_bytes"] == size]
        rate, window = plots.Series("ours"), plots.Series("floor")
        for level in levels:
            rate.add(level["rtt_added_s"] * 1e3, level["vs_plus_0"])
        for level in levels:
            window.add(level["rtt_added_s"] * 1e3, level["window_items"] / max(
                1.0, levels[0]["window_items"]))
        panels.append(plots.Panel(f"{fmt_size(size)} values",
                                  {"rate ÷ +0": rate, "window ÷ window at +0": window}))
    return [plots.lines(out_dir / "distance_ratios.png", panels, xlabel="added round trip (ms)",
                        ylabel="ratio", title="Read-ahead over distance (dp[i], prefetch=64)",
                        logy=False)]
