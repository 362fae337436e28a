"""Client latency and throughput of asynccache's read paths, with peers in the same run.

For every store of the run (Redis, Valkey, memcached) and every value size (100 B,
4 KiB, 64 KiB, 1 MiB of random ``bytes``), the values are written once under
asynccache's keys and, pickled, under plain keys for the peers; then, timed round-robin:

* ``asynccache get_many``: ``await cache.get_many(batch)``, ``in_flight`` batches
  outstanding, on uvloop in the main thread (an async service's view);
* ``asynccache dp[i]``: ``AsyncKVCacheMapDataPipe`` read in order with ``prefetch``
  (sequential read-ahead, batches on asynccache's loop thread);
* ``asynccache __getitems__``: the pipe read a batch at a time with ``set_order`` (what
  a DataLoader does with the sampler's order);
* the peers of `asynccache.bench.peers`: ``dict + pickle.loads``, a naive
  client (one round trip per item), the hand-written batched floor and aiocache.

Reported per case: items/s, MB/s (value bytes), p50/p95/p99 latency per item and per
batch at the consumer (per item: each ``dp[i]``, or a batch's time divided by its
size; per batch: each batch, or the sum of ``batch`` consecutive one-item reads), CPU
per item (this process, all threads), and the ratio of each asynccache path to each
peer. Two sweeps on 4 KiB values follow: batch size (1..256) and prefetch depth
(0..256).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import asynccache as ac

from ..cli.progress import Progress
from . import plots
from ._common import (
    BenchError,
    Case,
    Session,
    Store,
    UvloopRunner,
    batches_of,
    case_cells,
    chunks_by_bytes,
    fmt_ratio,
    fmt_size,
    make_values,
    markdown_table,
    measure,
    pickled,
    progress_bar,
    quiet_gc,
    ratio_cells,
    ratios,
    session_for,
    time_async_batches,
    time_batches,
    time_items,
)
from .peers import delete_keys, dict_case, peers_for, write_plain

SIZES = (100, 4096, 65536, 1 << 20)
#: items per repetition by value size: (full, quick, smoke)
ITEMS = {
    100: (10_000, 3_000, 300),
    4096: (6_000, 2_000, 200),
    65536: (1_500, 400, 64),
    1 << 20: (160, 48, 16),
}
SYNC_ITEMS = (1_500, 800, 100)  # cap for one-round-trip-per-item peers
BATCH = 64
BIG_VALUE_BATCH = 16  # 1 MiB values: 16 MiB per request, 64 MiB in flight
PREFETCH = 64
IN_FLIGHT = 4
SWEEP_SIZE = 4096
SWEEP_BATCHES = ((1, 16, 64, 256), (1, 16, 64, 256), (16, 64))
SWEEP_PREFETCH = ((0, 16, 64, 256), (0, 16, 64, 256), (0, 64))

GET_MANY, ITEM, GETITEMS = "asynccache get_many", "asynccache dp[i]", "asynccache __getitems__"


def batch_for(size: int) -> int:
    return BIG_VALUE_BATCH if size >= 1 << 20 else BATCH


# ------------------------------------------------------------------------------ readers


class Ours:
    """asynccache's three read paths over one keyspace of one store."""

    def __init__(
        self,
        store: Store,
        runner: UvloopRunner,
        namespace: str,
        values: Sequence[Any],
        ttl: float | None,
    ) -> None:
        self.runner = runner
        self.namespace = namespace
        self.values = values
        self.ttl = ttl
        self.client = ac.connect(store.url)
        self.cache = ac.AsyncKVCache(self.client, namespace=namespace, ttl=ttl)
        self.pipes: list[ac.AsyncKVCacheMapDataPipe] = []
        first = values[0]  # bytes, or an array: its bytes, not its length
        self.item_bytes = int(getattr(first, "nbytes", len(first)))

    def _pipe(self, prefetch: int) -> ac.AsyncKVCacheMapDataPipe:
        pipe = ac.AsyncKVCacheMapDataPipe(
            self.values, self.client, prefetch=prefetch, namespace=self.namespace, ttl=self.ttl
        )
        self.pipes.append(pipe)
        return pipe

    def get_many(self, n: int, batch: int, in_flight: int, name: str = GET_MANY) -> Case:
        batches = batches_of(list(range(n)), batch)
        cache = self.cache

        async def one(keys: Sequence[int]) -> int:
            return len(await cache.get_many(keys))

        return Case(
            name,
            "asynccache",
            n,
            self.item_bytes,
            batch,
            lambda: self.runner.run(time_async_batches(one, batches, in_flight)),
            {"in_flight": in_flight, "path": "get_many"},
        )

    def item(
        self,
        n: int,
        prefetch: int,
        group: int,
        name: str = ITEM,
        work: Callable[[], Any] | None = None,
    ) -> Case:
        pipe = self._pipe(prefetch)
        get = pipe.__getitem__

        def fn() -> Any:
            return _no_compute(pipe, lambda: time_items(get, range(n), work))

        return Case(
            name,
            "asynccache",
            n,
            self.item_bytes,
            group,
            fn,
            {"prefetch": prefetch, "path": "dp[i]", "work": work is not None},
        )

    def getitems(self, n: int, batch: int, prefetch: int, name: str = GETITEMS) -> Case:
        pipe = self._pipe(prefetch)
        order = list(range(n))
        batches = batches_of(order, batch)

        def epoch() -> Any:
            if prefetch:
                pipe.set_order(order)  # the sampler's order, as a DataLoader user gives it
            return time_batches(pipe.__getitems__, batches)

        return Case(
            name,
            "asynccache",
            n,
            self.item_bytes,
            batch,
            lambda: _no_compute(pipe, epoch),
            {"prefetch": prefetch, "path": "__getitems__"},
        )

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()
        self.runner.run(self.cache.aclose())


def _no_compute(pipe: ac.AsyncKVCacheMapDataPipe, fn: Callable[[], Any]) -> Any:
    """Run a timed pass; a value computed from the source means the store missed it."""
    before = pipe.stats().get("computed", 0)
    rep = fn()
    missed = pipe.stats().get("computed", 0) - before
    if missed:
        raise BenchError(
            f"{missed} reads missed the store and were computed (evicted? timeouts?): "
            f"stats {pipe.stats()}"
        )
    return rep


class Workload:
    """``n`` values of one size in one store: under asynccache's keys and, pickled, under
    plain keys for the peers. Written on enter, deleted on exit (untimed)."""

    def __init__(
        self, session: Session, store: Store, size: int, n: int, tag: str, runner: UvloopRunner,
        kind: str = "bytes",
    ) -> None:
        self.store = store
        self.size = size
        self.runner = runner
        self.ttl = session.ttl(store)
        self.namespace = session.namespace(tag if kind == "bytes" else f"{tag}-{kind}", size)
        self.values: list[Any] = make_values(size, n)
        if kind == "array":  # what a sample is: a float32 array of the same bytes
            import numpy as np

            self.values = [np.frombuffer(v, dtype=np.float32).copy() for v in self.values]
        self.blobs = pickled(self.values)
        self.plain_keys = [f"{self.namespace}-pk:{i}" for i in range(n)]
        # A --url-memcached server with a small -I cannot hold 1 MiB values whole: the
        # peers cannot store them at all, asynccache splits them into chunks.
        self.peers_ok = store.fits(max(len(b) for b in self.blobs))
        self._store_keys: list[bytes] = []

    def __enter__(self) -> Workload:
        client = ac.connect(self.store.url)
        cache = ac.AsyncKVCache(client, namespace=self.namespace, ttl=self.ttl)

        async def write() -> None:
            for chunk in chunks_by_bytes(list(enumerate(self.values))):
                await cache.set_many(dict(chunk))
            await cache.aclose()

        self._store_keys = [cache.key(i) for i in range(len(self.values))]
        try:
            self.runner.run(write())
            if self.peers_ok:
                write_plain(self.store, self.plain_keys, self.blobs, self.ttl)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            delete_keys(self.store, [*self._store_keys, *self.plain_keys])


@contextlib.contextmanager
def readers(store: Store, w: Workload, runner: UvloopRunner) -> Iterator[tuple[Ours, Any]]:
    """asynccache and the peers, reading ``w`` from ``store`` (maybe through a proxy)."""
    ours = Ours(store, runner, w.namespace, w.values, w.ttl)
    peers = peers_for(store, runner, IN_FLIGHT)
    try:
        yield ours, peers
    finally:
        try:
            ours.close()
        finally:
            peers.close()


# -------------------------------------------------------------------------------- run


def run(
    *, quick: bool, out_dir: Path, progress: bool, session: Session | None = None
) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc():
        mode = s.mode_index
        results: dict[str, Any] = {
            "config": {
                "sizes": list(SIZES),
                "items": {str(k): v[mode] for k, v in ITEMS.items()},
                "sync_items": SYNC_ITEMS[mode],
                "batch": BATCH,
                "big_value_batch": BIG_VALUE_BATCH,
                "prefetch": PREFETCH,
                "in_flight": IN_FLIGHT,
                "reps": s.reps,
                "warmup": s.warmup,
                "sweep_size": SWEEP_SIZE,
                "sweep_batches": list(SWEEP_BATCHES[mode]),
                "sweep_prefetch": list(SWEEP_PREFETCH[mode]),
                "mode": s.mode,
            },
            "by_size": [],
            "batch_sweep": [],
            "prefetch_sweep": [],
        }
        runner = UvloopRunner()
        bar = progress_bar(0, "latency", s.progress)
        try:
            for store in s.stores.values():
                for size in SIZES:
                    bar.describe(f"latency {store.name} {fmt_size(size)}")
                    results["by_size"].append(_by_size(s, store, size, mode, runner, bar))
            sweep_stores = list(s.stores.values())
            if s.mode != "full":  # the first store is enough for a quick look
                sweep_stores = sweep_stores[:1]
            for store in sweep_stores:
                bar.describe(f"latency {store.name} sweeps")
                batch_sweep, prefetch_sweep = _sweeps(s, store, mode, runner, bar)
                results["batch_sweep"].append(batch_sweep)
                results["prefetch_sweep"].append(prefetch_sweep)
        finally:
            bar.close()
            runner.close()
    return results


def _grow(bar: Progress, cases: Sequence[Case], s: Session) -> None:
    bar.add_total(len(cases) * (s.reps + s.warmup))


def _by_size(
    s: Session, store: Store, size: int, mode: int, runner: UvloopRunner, bar: Progress
) -> dict[str, Any]:
    n = ITEMS[size][mode]
    n_sync = min(n, SYNC_ITEMS[mode])
    batch = batch_for(size)
    with Workload(s, store, size, n, "lat", runner) as w, readers(store, w, runner) as rd:
        ours, peers = rd
        cases = [
            ours.get_many(n, batch, IN_FLIGHT),
            ours.item(n, PREFETCH, batch),
            ours.getitems(n, batch, PREFETCH),
            dict_case(w.blobs, n, size, batch),
        ]
        if w.peers_ok:
            cases += [
                peers.naive(w.plain_keys, n_sync, size, batch),
                peers.floor(w.plain_keys, n, size, batch),
                peers.aiocache(w.plain_keys, n, size, batch),
            ]
        _grow(bar, cases, s)
        measured = measure(cases, s.reps, s.warmup, bar)
    return {
        "store": store.name,
        "server": store.label,
        "value_bytes": size,
        "items": n,
        "batch": batch,
        "prefetch": PREFETCH,
        "in_flight": IN_FLIGHT,
        "cases": measured,
        "ratios": ratios(measured),
        "p99_item_ratios": ratios(_inverse_p99(measured), "inv_p99"),
        "note": None if w.peers_ok else f"peers skipped: {store.item_size}-byte item limit",
    }


def _inverse_p99(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Cases with ``1/p99`` per item as a metric, so that ``ratios`` says how many times
    lower (better) asynccache's p99 is than each peer's."""
    return {
        name: {"role": c["role"], "inv_p99": 1 / c["item_us"]["p99"]}
        for name, c in cases.items()
        if c["item_us"].get("p99")
    }


def _sweeps(
    s: Session, store: Store, mode: int, runner: UvloopRunner, bar: Progress
) -> tuple[dict[str, Any], dict[str, Any]]:
    size = SWEEP_SIZE
    n_full = ITEMS[size][mode]
    with Workload(s, store, size, n_full, "sweep", runner) as w, readers(store, w, runner) as rd:
        ours, peers = rd
        cases = []
        for b in SWEEP_BATCHES[mode]:
            n = min(n_full, max(200, 200 * b))  # small batches are slow: fewer items
            cases += [
                ours.get_many(n, b, IN_FLIGHT, name=f"get_many b={b}"),
                ours.getitems(n, b, max(PREFETCH, 2 * b), name=f"__getitems__ b={b}"),
            ]
            if w.peers_ok:
                floor = peers.floor(w.plain_keys, n, size, b)
                floor.name = f"{peers.floor_name} b={b}"
                aio = peers.aiocache(w.plain_keys, n, size, b)
                aio.name = f"{peers.aiocache_name} b={b}"
                cases += [floor, aio]
        for case in cases:
            case.params["sweep"] = case.batch
        _grow(bar, cases, s)
        batch_cases = measure(cases, s.reps, s.warmup, bar)

        cases = []
        for p in SWEEP_PREFETCH[mode]:
            n = n_full if p else min(n_full, SYNC_ITEMS[mode])
            cases += [
                ours.item(n, p, BATCH, name=f"dp[i] p={p}"),
                ours.getitems(n_full, BATCH, p, name=f"__getitems__ p={p}"),
            ]
        for case in cases:
            case.params["sweep"] = case.params["prefetch"]
        _grow(bar, cases, s)
        prefetch_cases = measure(cases, s.reps, s.warmup, bar)
    common = {
        "store": store.name,
        "server": store.label,
        "value_bytes": size,
        "in_flight": IN_FLIGHT,
    }
    by_batch: dict[str, dict[str, float]] = {}
    for b in SWEEP_BATCHES[mode]:
        sub = {k: v for k, v in batch_cases.items() if k.endswith(f" b={b}")}
        by_batch[str(b)] = {
            f"{a} / {p}": r for a, row in ratios(sub).items() for p, r in row.items()
        }
    return (
        {
            **common,
            "axis": "batch",
            "prefetch": "max(64, 2*batch)",
            "cases": batch_cases,
            "ratios_by_batch": by_batch,
        },
        {**common, "axis": "prefetch", "batch": BATCH, "cases": prefetch_cases},
    )


# ------------------------------------------------------------------------------ report


def table(results: dict[str, Any]) -> str:
    out = ["### Reads by value size (warm, loopback)", ""]
    out.append(
        "Per item: each `dp[i]` / per-key call, or a batch's time over its size; per batch: "
        "each batch, or the sum of `batch` consecutive one-item reads. µs, median over "
        "repetitions. Ratios: this row's items/s over the peer's (same run, server, values)."
    )
    out.append("")
    headers = [
        "store / value / case",
        "items/s",
        "MB/s",
        "p50 item",
        "p95 item",
        "p99 item",
        "p50 batch",
        "p99 batch",
        "CPU µs/item",
        "÷ naive",
        "÷ floor",
        "÷ aiocache",
        "÷ dict",
    ]
    rows = []
    for block in results.get("by_size", []):
        label = f"{block['store']} {fmt_size(block['value_bytes'])}"
        for name, c in block["cases"].items():
            rows.append(
                [
                    f"{label} · {name}",
                    *case_cells(c),
                    *ratio_cells(block, name, ("naive", "floor", "aiocache", "dict")),
                ]
            )
        if block.get("note"):
            rows.append([f"{label} · ({block['note']})", *[""] * (len(headers) - 1)])
    out.append(markdown_table(headers, rows))

    for key, title in (
        ("batch_sweep", "Batch size sweep"),
        ("prefetch_sweep", "Prefetch depth sweep"),
    ):
        if not results.get(key):
            continue
        out += ["", f"### {title} ({fmt_size(results['config']['sweep_size'])} values)", ""]
        rows = []
        for block in results[key]:
            for name, c in block["cases"].items():
                rows.append(
                    [
                        f"{block['store']} · {name}",
                        *case_cells(c, item=("p50", "p99"), batch=("p99",)),
                    ]
                )
        out.append(
            markdown_table(
                [
                    "store · case",
                    "items/s",
                    "MB/s",
                    "p50 item",
                    "p99 item",
                    "p99 batch",
                    "CPU µs/item",
                ],
                rows,
            )
        )
        if key == "batch_sweep":
            out += ["", "Ratios by batch size (items/s over items/s):", ""]
            rows = []
            for block in results[key]:
                for b, pairs in block["ratios_by_batch"].items():
                    for pair, r in pairs.items():
                        rows.append([f"{block['store']} b={b} · {pair}", fmt_ratio(r)])
            out.append(markdown_table(["store · pair", "ratio"], rows))
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = []
    blocks = results.get("by_size", [])
    stores = list(dict.fromkeys(b["store"] for b in blocks))
    sizes = sorted({b["value_bytes"] for b in blocks})
    for metric, sub, ylabel, name in (
        ("items_per_s", None, "items/s", "latency_items_per_s.png"),
        ("mb_per_s", None, "MB/s (value bytes)", "latency_mb_per_s.png"),
        ("item_us", "p99", "p99 latency per item (µs)", "latency_p99_item.png"),
    ):
        panels = []
        for store in stores:
            series: dict[str, plots.Series] = {}
            for block in (b for b in blocks if b["store"] == store):
                x = sizes.index(block["value_bytes"])
                for case_name, c in block["cases"].items():
                    y = c[metric] if sub is None else c[metric].get(sub)
                    s = series.setdefault(case_name, plots.Series(role=c["role"]))
                    s.add(x, y)
            panels.append(plots.Panel(store, series))
        paths.append(
            plots.lines(
                out_dir / name,
                panels,
                xlabel="value size",
                ylabel=ylabel,
                xticks=(list(range(len(sizes))), [fmt_size(v) for v in sizes]),
                title=f"warm reads on loopback: {ylabel}",
            )
        )
    for key, axis, name in (
        ("batch_sweep", "batch size", "latency_batch_sweep.png"),
        ("prefetch_sweep", "prefetch depth", "latency_prefetch_sweep.png"),
    ):
        blocks = results.get(key, [])
        if not blocks:
            continue
        panels = []
        for metric, ylabel in (("items_per_s", "items/s"), ("p99", "p99 per item (µs)")):
            for block in blocks:
                xs = sorted({c["sweep"] for c in block["cases"].values()})
                series = {}
                for case_name, c in block["cases"].items():
                    base = case_name.rsplit(" ", 1)[0]
                    y = c["items_per_s"] if metric == "items_per_s" else c["item_us"]["p99"]
                    series.setdefault(base, plots.Series(role=c["role"])).add(
                        xs.index(c["sweep"]), y
                    )
                panels.append(
                    plots.Panel(
                        f"{block['store']}: {ylabel}",
                        series,
                        xticks=(list(range(len(xs))), [str(x) for x in xs]),
                    )
                )
        paths.append(
            plots.lines(
                out_dir / name,
                panels,
                xlabel=axis,
                ylabel="",
                title=f"{fmt_size(results['config']['sweep_size'])} values, by {axis}",
                columns=len(blocks),
            )
        )
    return paths
