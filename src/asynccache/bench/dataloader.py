"""The seed's three claims, measured with a multi-worker torch DataLoader.

A per-worker dict (what ``InMemoryCacheHolder`` is) against ``async_kv_cache`` on a
Redis-compatible store, over the demo's synthetic images (a real CPU cost per item):

1. **memory** -- a dict is filled separately in every worker process, so each worker's
   RSS grows with the data it has seen (and with 0 workers the training process holds
   it all); with ``async_kv_cache`` the data lives once, in the store, and the workers
   stay flat. Measured as the cached data grows (item counts N1 < N2 < N3).
2. **sharing** -- a dict is shared neither between workers nor, with non-persistent
   workers, between epochs: the warm epoch computes everything again; with persistent
   workers it computes what the worker that now gets an item did not see itself. With
   ``async_kv_cache`` the warm epoch computes nothing. Measured as calls of the source's
   ``__getitem__`` in all processes (a shared counter) and the hit rate per epoch.
3. **epoch time** -- cold and warm, for 0, 2 and 4 workers (shuffle=True), non-persistent
   and persistent.

Every (cache, size, loader) combination starts fresh -- a new dict, a new namespace in
the store (flushed afterwards when the store is our private server) -- and runs a cold
then a warm epoch; persistent workers serve both epochs, non-persistent ones are
started anew for each. RSS is sampled from the parent with psutil (the demo's sampler);
"growth" is peak RSS minus the RSS the worker had when it started (its
``worker_init_fn``): the cached data, the heap it fragments, and a constant part for
the library code and buffers a worker pages in on its first items (the same for both
caches: compare the columns, not the absolute values). RSS counts pages shared with
the parent (torch's libraries, the parent's heap) in every worker, so "total" (the sum
over workers) overstates what the machine spends. The store's share is its
``used_memory`` delta. Each epoch is timed once: on a shared machine (the load average
is recorded) small differences are noise. A checksum of every epoch's pixels must be
the same for a given size, so a cache returning wrong values shows up as
``data_ok: false``.

Interface (the benchmark CLI calls it): `run`, `table`, `plot`.
Alone: ``python -m asynccache.bench.dataloader [--quick] [--out DIR] [--url URL]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import importlib.metadata
import json
import multiprocessing
import os
import platform
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, cast

import psutil
import torch
from torch.utils.data import DataLoader

from ..cli import demo_epochs as _demo
from ..cli.demo import URL_TTL
from ..cli.demo_epochs import (
    ASYNC_CACHE,
    COLD,
    DICT_CACHE,
    MIB,
    OUT_SIZE,
    RAW_SIZE,
    WARM,
    InMemoryCache,
    SyntheticImages,
    _init_worker,
    decode,
    measure_item_cost,
    timed_pass,
)
from ..cli.progress import Progress
from ..readahead.datapipe import AsyncKVCacheMapDataPipe
from ..store.connect import connect
from ..store.memcached.client import MemcachedClient
from ..testing import servers
from ._common import cpu_model

__all__ = ["CACHES", "LOADERS", "main", "plot", "run", "table"]

#: Item counts N1 < N2 < N3 (the cached data grows with them).
FULL_SIZES = (1000, 2000, 4000)
QUICK_SIZES = (48, 96, 192)
FULL_BATCH = 32
QUICK_BATCH = 16
#: (workers, persistent); persistent workers need at least one worker.
LOADERS: tuple[tuple[int, bool], ...] = ((0, False), (2, False), (2, True), (4, False), (4, True))
CACHES = (DICT_CACHE, ASYNC_CACHE)
PREFETCH = 64
SEED = 0
RESULTS_NAME = "dataloader.json"
# torch warns when a DataLoader has more workers than cores: 4 on 2 cores is on purpose.
_OVERSUBSCRIBED = r"This DataLoader will create \d+ worker processes in total"


# ------------------------------------------------------------------------------ running


def _sizes(quick: bool, items: int | None) -> tuple[int, ...]:
    if items is None:
        return QUICK_SIZES if quick else FULL_SIZES
    if items < 1:
        raise ValueError(f"items must be at least 1, got {items}")
    return tuple(sorted({max(1, items // 4), max(1, items // 2), items}))


def _record_start(calls: Any, pids: Any, start_rss: Any, worker_id: int) -> None:
    """``worker_init_fn``: the demo's counter and pid, plus this worker's RSS at start."""
    _init_worker(calls, pids, worker_id)
    start_rss[worker_id] = psutil.Process().memory_info().rss


def _release_memory() -> None:
    """Give freed heap back to the OS, so the next fork does not start with it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextlib.contextmanager
def _store(url: str | None) -> Iterator[servers.RedisServer | None]:
    if url:
        yield None
        return
    with servers.start_redis() as server:
        yield server


def _store_used(server: servers.RedisServer | None) -> int | None:
    """The private server's ``used_memory`` in bytes (None for a store given by URL)."""
    if server is None:
        return None
    info = server.call("INFO", "memory").decode(errors="replace")
    for line in info.splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":", 1)[1])
    return None


def _loader_label(workers: int, persistent: bool) -> str:
    if workers == 0:
        return "0 workers (main process)"
    return f"{workers} workers" + (", persistent" if persistent else "")


def _epoch(
    loader: DataLoader,
    n: int,
    calls: Any,
    pids: Any,
    start_rss: Any,
    label: str,
    bar: Progress,
) -> dict[str, Any]:
    with calls.get_lock():
        calls.value = 0
    bar.describe(f"dataloader: {label}")
    seconds, checksum, peaks = timed_pass(loader, pids, bar)
    computed = int(calls.value)
    return {
        "seconds": round(seconds, 4),
        "items_per_s": round(n / seconds, 1) if seconds > 0 else None,
        "computed": computed,
        "hit_rate": (n - computed) / n,
        "peak_rss_mib": [round(p / MIB, 1) for p in peaks],
        "start_rss_mib": [round(s / MIB, 1) for s in start_rss[:]],
        "checksum": checksum,
    }


def _memory_summary(epochs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    peaks = [p for e in epochs for p in e["peak_rss_mib"] if p]
    growth = [
        p - s
        for e in epochs
        for p, s in zip(e["peak_rss_mib"], e["start_rss_mib"], strict=True)
        if p and s
    ]
    totals = [sum(e["peak_rss_mib"]) for e in epochs]
    return {
        "peak_rss_per_worker_mib": max(peaks) if peaks else None,
        "growth_per_worker_mib": round(max(growth), 1) if growth else None,
        "total_rss_mib": round(max(totals), 1) if totals else None,
    }


def _run_config(
    cache: str,
    n: int,
    workers: int,
    persistent: bool,
    *,
    client: Any,
    server: servers.RedisServer | None,
    ttl: float | None,
    ctx: BaseContext,
    batch_size: int,
    item_bytes: int,
    bar: Progress,
) -> dict[str, Any]:
    """A cold and a warm epoch of one (cache, size, loader) on fresh state."""
    source = SyntheticImages(n)
    dataset: Any
    if cache == DICT_CACHE:
        dataset = InMemoryCache(source)
    else:
        namespace = f"bench-dl-{uuid.uuid4().hex[:12]}"
        dataset = AsyncKVCacheMapDataPipe(
            source, client, prefetch=PREFETCH, namespace=namespace, ttl=ttl
        )
    slots = max(1, workers)
    calls = ctx.Value("q", 0)
    pids = ctx.Array("q", slots)
    start_rss = ctx.Array("q", slots)
    in_process = workers == 0
    store_before = _store_used(server)
    store_after = None
    generator = torch.Generator().manual_seed(SEED)  # both epochs draw from it in turn
    loader: DataLoader | None = None
    epochs = []
    threads = torch.get_num_threads()
    try:
        if in_process:  # the main process reads: count its calls, sample its RSS
            _init_worker(calls, pids, 0)
            start_rss[0] = psutil.Process().memory_info().rss
            # One torch thread, as in a DataLoader worker: the same work per item in
            # every configuration (and no OpenMP spinning on a busy machine).
            torch.set_num_threads(1)
        for epoch in (COLD, WARM):
            if loader is None or not persistent:
                if not in_process:
                    pids[:] = [0] * slots
                    start_rss[:] = [0] * slots
                loader = DataLoader(
                    dataset,
                    batch_size=batch_size,
                    shuffle=True,
                    num_workers=workers,
                    persistent_workers=persistent,
                    multiprocessing_context=None if in_process else ctx,
                    worker_init_fn=None
                    if in_process
                    else functools.partial(_record_start, calls, pids, start_rss),
                    generator=generator,
                )
            label = f"{cache} {n} {_loader_label(workers, persistent)} {epoch}"
            result = _epoch(loader, n, calls, pids, start_rss, label, bar)
            epochs.append({"epoch": epoch, **result})
        store_after = _store_used(server)
    finally:
        loader = None  # shuts persistent workers down
        if in_process:
            _demo._calls = None
            torch.set_num_threads(threads)
        if isinstance(dataset, AsyncKVCacheMapDataPipe):
            dataset.close()
        del dataset
        _release_memory()
        if server is not None:
            server.call("FLUSHALL")
    return {
        "cache": cache,
        "items": n,
        "workers": workers,
        "persistent": persistent,
        "cached_mib": round(n * item_bytes / MIB, 2),
        "store_mib": None
        if store_before is None or store_after is None
        else round((store_after - store_before) / MIB, 2),
        **_memory_summary(epochs),
        "epochs": epochs,
    }


# -------------------------------------------------------------------------- description


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _external_server(url: str, client: Any) -> tuple[str | None, str | None]:
    """(kind, version) of the store given by URL, best effort (None when unknown)."""
    if isinstance(client, MemcachedClient):
        try:
            with socket.create_connection(client.servers[0], timeout=2) as sock:
                sock.sendall(b"version\r\n")
                reply = sock.recv(256).decode(errors="replace").split()
        except OSError:
            return "memcached", None
        return "memcached", reply[1] if len(reply) > 1 and reply[0] == "VERSION" else None
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None, None
    try:
        import redis

        with redis.Redis.from_url(url, socket_timeout=2) as conn:
            info = conn.info("server")
    except Exception:  # a description must not fail the benchmark
        return None, None
    kind = "valkey" if "valkey_version" in info or info.get("server_name") == "valkey" else "redis"
    return kind, str(info.get("valkey_version") or info.get("redis_version") or "") or None


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _machine(server: servers.RedisServer | None, url: str | None, client: Any) -> dict[str, Any]:
    kind: str | None
    version: str | None
    if server is not None:
        kind, version, where = server.kind, server.version, f"private, {server.url}"
    else:
        assert url is not None
        kind, version = _external_server(url, client)
        where = f"existing store {client.safe_url}"
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "asynccache": _version("asynccache"),
        "redis_py": _version("redis"),
        "uvloop": _version("uvloop"),
        "server_kind": kind,
        "server_version": version,
        "store": where,
        "load_average_start": _load_average(),
    }


# -------------------------------------------------------------------------------- public


def run(
    *,
    quick: bool,
    out_dir: Path,
    progress: bool,
    url: str | None = None,
    items: int | None = None,
) -> dict[str, Any]:
    """Measure every (size, loader, cache) combination; JSON-able results.

    ``url``: use that store instead of starting a private redis-server (values then
    expire after the demo's URL TTL and are not flushed). ``items``: the largest size
    (N3; N1 and N2 are a quarter and a half of it), overriding the quick/full sizes.
    The results are also written to ``out_dir/dataloader.json``.
    """
    began = time.perf_counter()
    sizes = _sizes(quick, items)
    batch_size = QUICK_BATCH if quick else FULL_BATCH
    ctx = multiprocessing.get_context()
    cost = measure_item_cost()
    sample = decode(0)["image"]
    item_bytes = sample.numel() * sample.element_size()
    # Worker configurations first: the 0-worker async_kv_cache runs start asynccache's
    # loop thread in this process, and no later fork should inherit a running thread.
    combos = [
        (n, w, p, c)
        for in_process in (False, True)
        for n in sizes
        for w, p in LOADERS
        if (w == 0) == in_process
        for c in CACHES
    ]
    runs: list[dict[str, Any]] = []
    total = sum(2 * n for n, _w, _p, _c in combos)  # items read: a cold and a warm epoch each
    with _store(url) as server, warnings.catch_warnings(), \
            Progress(total, "dataloader", unit="item", enabled=progress, log_stages=True) as bar:
        warnings.filterwarnings("ignore", message=_OVERSUBSCRIBED, category=UserWarning)
        client = connect(server.url if server is not None else cast(str, url))
        machine = _machine(server, url, client)
        machine["start_method"] = ctx.get_start_method()
        for done, (n, workers, persistent, cache) in enumerate(combos, 1):
            record = _run_config(
                cache,
                n,
                workers,
                persistent,
                client=client,
                server=server,
                ttl=URL_TTL if server is None else None,
                ctx=ctx,
                batch_size=batch_size,
                item_bytes=item_bytes,
                bar=bar,
            )
            runs.append(record)
            if progress:
                cold, warm = record["epochs"]
                bar.write(
                    f"[{done}/{len(combos)}] {cache:<15} {n:>5} items, "
                    f"{_loader_label(workers, persistent):<24}: cold {cold['seconds']:6.2f} s "
                    f"({cold['computed']} computed), warm {warm['seconds']:6.2f} s "
                    f"({warm['computed']} computed)",
                    file=sys.stderr,
                )
    machine["load_average_end"] = _load_average()
    checksums: dict[int, set[int]] = {}
    for record in runs:
        for epoch in record["epochs"]:
            checksums.setdefault(record["items"], set()).add(epoch["checksum"])
    results = {
        "benchmark": "dataloader",
        "quick": quick,
        "machine": machine,
        "dataset": {
            "kind": "asynccache.cli.demo_epochs.SyntheticImages",
            "raw": f"3x{RAW_SIZE}x{RAW_SIZE}",
            "item": f"3x{OUT_SIZE}x{OUT_SIZE} uint8",
            "item_bytes": item_bytes,
            "item_cost_ms": round(cost * 1e3, 3),
        },
        "sizes": list(sizes),
        "loaders": [list(loader) for loader in LOADERS],
        "caches": list(CACHES),
        "batch_size": batch_size,
        "prefetch": PREFETCH,
        "shuffle": True,
        "runs": runs,
        "data_ok": all(len(sums) == 1 for sums in checksums.values()),
        "seconds": round(time.perf_counter() - began, 1),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULTS_NAME).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def _find(results: dict[str, Any], cache: str, n: int, workers: int, persistent: bool) -> Any:
    for record in results["runs"]:
        if (record["cache"], record["items"], record["workers"], record["persistent"]) == (
            cache,
            n,
            workers,
            persistent,
        ):
            return record
    raise KeyError((cache, n, workers, persistent))


def _md(headers: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _mib(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def _rate(rate: float) -> str:
    if rate in (0.0, 1.0):
        return f"{rate:.0%}"
    return f"{int(rate * 1000) / 10:.1f}%"  # truncated: 1999 of 2000 is not "100%"


def _machine_line(results: dict[str, Any]) -> str:
    m = results["machine"]
    load = m.get("load_average_start")
    return (
        f"{m['cpu_model']}, {m['cpus_usable']} cores, {m['memory_gib']} GiB, {m['platform']}, "
        f"Python {m['python']}, torch {m['torch']}, "
        f"{m['server_kind'] or 'store'} {m['server_version'] or '?'} ({m['store']}), "
        f"start method {m['start_method']}"
        + (f"; load average at start {'/'.join(f'{x:g}' for x in load)}" if load else "")
    )


def table(results: dict[str, Any]) -> str:
    """Markdown: the machine, then one table per claim."""
    sizes, loaders = results["sizes"], [tuple(lo) for lo in results["loaders"]]
    largest = sizes[-1]
    d = results["dataset"]
    out = [
        "## DataLoader: per-worker dict vs async_kv_cache",
        "",
        f"Machine: {_machine_line(results)}.",
        "",
        f"Dataset: `SyntheticImages`, {d['raw']} -> {d['item']} ({d['item_bytes'] / 1024:.0f} "
        f"KiB per item), `__getitem__` {d['item_cost_ms']:.2f} ms (one thread); batch size "
        f"{results['batch_size']}, shuffle, prefetch {results['prefetch']}; sizes "
        f"{', '.join(map(str, sizes))} items. Every cell is a fresh cache (cold epoch, then "
        f"warm). 4 workers on {results['machine']['cpus_usable']} cores oversubscribe the CPU "
        f"on purpose. Data identical in every epoch: {results['data_ok']}. "
        f"Run took {results['seconds']:.0f} s.",
        "",
        "### (1) Memory as the cached data grows (MiB)",
        "",
        "Peak RSS of the busiest worker (the main process with 0 workers); its growth "
        "(peak minus RSS at worker start: the cached data and the heap it fragments, plus "
        "a constant for code and buffers paged in on the first items, the same for both "
        "caches); the sum of the workers' peaks (counts shared pages once per worker); "
        "and for async_kv_cache the store's `used_memory` for the same data.",
        "",
    ]
    rows = []
    for workers, persistent in loaders:
        for n in sizes:
            dct = _find(results, DICT_CACHE, n, workers, persistent)
            akv = _find(results, ASYNC_CACHE, n, workers, persistent)
            rows.append(
                [
                    _loader_label(workers, persistent),
                    str(n),
                    f"{dct['cached_mib']:.1f}",
                    _mib(dct["peak_rss_per_worker_mib"]),
                    _mib(dct["growth_per_worker_mib"]),
                    _mib(dct["total_rss_mib"]),
                    _mib(akv["peak_rss_per_worker_mib"]),
                    _mib(akv["growth_per_worker_mib"]),
                    _mib(akv["total_rss_mib"]),
                    "?" if akv["store_mib"] is None else f"{akv['store_mib']:.1f}",
                ]
            )
    out.append(
        _md(
            [
                "loader",
                "items",
                "data",
                "dict peak/worker",
                "dict growth/worker",
                "dict total",
                "akv peak/worker",
                "akv growth/worker",
                "akv total",
                "akv store",
            ],
            rows,
        )
    )
    out += [
        "",
        f"### (2) Sharing: items computed per epoch ({largest} items)",
        "",
        "Calls of the source's `__getitem__` in all processes; hit rate = 1 - computed/items.",
        "",
    ]
    rows = []
    for workers, persistent in loaders:
        cells = [_loader_label(workers, persistent)]
        for cache in CACHES:
            cold, warm = _find(results, cache, largest, workers, persistent)["epochs"]
            cells += [str(cold["computed"]), str(warm["computed"]), _rate(warm["hit_rate"])]
        rows.append(cells)
    out.append(
        _md(
            [
                "loader",
                "dict cold",
                "dict warm",
                "dict warm hit rate",
                "akv cold",
                "akv warm",
                "akv warm hit rate",
            ],
            rows,
        )
    )
    out += [
        "",
        f"### (3) Epoch time, seconds ({largest} items)",
        "",
        "Wall time of one pass, worker start-up included (non-persistent workers start "
        "every epoch), measured once: compare with the load average above. Last column: "
        "dict warm time / async_kv_cache warm time.",
        "",
    ]
    rows = []
    for workers, persistent in loaders:
        dct = _find(results, DICT_CACHE, largest, workers, persistent)["epochs"]
        akv = _find(results, ASYNC_CACHE, largest, workers, persistent)["epochs"]
        rows.append(
            [
                _loader_label(workers, persistent),
                f"{dct[0]['seconds']:.2f}",
                f"{dct[1]['seconds']:.2f}",
                f"{akv[0]['seconds']:.2f}",
                f"{akv[1]['seconds']:.2f}",
                f"{dct[1]['seconds'] / akv[1]['seconds']:.1f}x",
            ]
        )
    out.append(
        _md(
            ["loader", "dict cold", "dict warm", "akv cold", "akv warm", "warm: dict/akv"],
            rows,
        )
    )
    out.append("")
    out.append("akv = async_kv_cache.")
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Three PNGs (matplotlib, Agg): RSS vs cached data, epoch times, items computed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes, loaders = results["sizes"], [tuple(lo) for lo in results["loaders"]]
    largest = sizes[-1]
    colors = {DICT_CACHE: "tab:red", ASYNC_CACHE: "tab:blue"}
    markers = ["o", "s", "D", "^", "v", "P", "X"]
    paths = []

    # (1) RSS per worker and in total vs cached data
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for (workers, persistent), marker in zip(loaders, markers):
        for cache in CACHES:
            recs = [_find(results, cache, n, workers, persistent) for n in sizes]
            x = [r["cached_mib"] for r in recs]
            style = "-" if cache == DICT_CACHE else "--"
            label = f"{cache}, {_loader_label(workers, persistent)}"
            kwargs = {"color": colors[cache], "marker": marker, "linestyle": style}
            axes[0].plot(x, [r["peak_rss_per_worker_mib"] for r in recs], label=label, **kwargs)
            totals = [
                (r["total_rss_mib"] or 0) + (r["store_mib"] or 0 if cache == ASYNC_CACHE else 0)
                for r in recs
            ]
            axes[1].plot(x, totals, **kwargs)
    axes[0].set_title("peak RSS per worker (main process with 0 workers)")
    axes[1].set_title("sum of worker peaks (+ store used_memory for async_kv_cache)")
    for ax in axes:
        ax.set_xlabel("cached data (MiB of decoded items)")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    paths.append(_save(fig, out_dir / "dataloader_rss.png", plt))

    # (3) epoch time cold/warm by loader, (2) computed per epoch by loader
    labels = [_loader_label(w, p).replace(" (main process)", "") for w, p in loaders]
    series = [(cache, epoch) for cache in CACHES for epoch in (COLD, WARM)]
    for metric, title, name in (
        ("seconds", f"epoch time ({largest} items)", "dataloader_epoch_time.png"),
        ("computed", f"items computed per epoch ({largest} items)", "dataloader_computed.png"),
    ):
        fig, ax = plt.subplots(figsize=(10, 4.8))
        width = 0.8 / len(series)
        for k, (cache, epoch) in enumerate(series):
            values = [
                _find(results, cache, largest, w, p)["epochs"][0 if epoch == COLD else 1][metric]
                for w, p in loaders
            ]
            bars = ax.bar(
                [i + (k - (len(series) - 1) / 2) * width for i in range(len(loaders))],
                values,
                width,
                label=f"{cache} {epoch}",
                color=colors[cache],
                alpha=1.0 if epoch == COLD else 0.5,
                hatch="" if epoch == COLD else "//",
            )
            ax.bar_label(bars, fmt="%.2f" if metric == "seconds" else "%d", fontsize=7)
        ax.set_xticks(range(len(loaders)), labels)
        ax.set_ylabel("seconds" if metric == "seconds" else "items")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1))
        fig.tight_layout()
        paths.append(_save(fig, out_dir / name, plt))
    return paths


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------- command


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asynccache.bench.dataloader",
        description="Per-worker dict vs async_kv_cache in a multi-worker DataLoader: "
        "memory, sharing, cold/warm epoch time.",
    )
    parser.add_argument("--quick", action="store_true", help="few items (< 45 s)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--url", help="use this store instead of a private redis-server")
    parser.add_argument("--items", type=int, help="largest dataset size (N3)")
    args = parser.parse_args(argv)
    results = run(quick=args.quick, out_dir=args.out, progress=True, url=args.url, items=args.items)
    print(table(results))
    for path in plot(results, args.out):
        print(f"wrote {path}")
    print(f"wrote {args.out / RESULTS_NAME}")
    return 0 if results["data_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
