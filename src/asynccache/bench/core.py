"""``AsyncKVCache.get_many`` throughput against a hand-written ``redis.asyncio`` floor.

(Formerly ``bench/bench_core.py``.) On the run's first Redis-protocol store (127.0.0.1
TCP). Workload: ``bytes`` values of 100 B and 64 KiB, read in batches of 64 keys with 4
requests in flight, on uvloop, in the main thread:

* ``asynccache get_many``: 4 workers, each ``await cache.get_many(64 keys)`` in turn.
* ``hand-written MGET``: the same shape with ``redis.asyncio.Redis`` (hiredis), ``MGET``
  of 64 keys and ``pickle.loads`` of every hit into a dict. Values are stored with plain
  ``pickle.dumps``. It is the fair floor: asynccache's work minus its codec header and
  checksum, namespacing and stats.
* attribution, layer by layer in the same shape: asynccache's ``RedisClient`` alone
  with ``pickle.loads``, then with its codec, then the whole core.
* ``asynccache get() x64 gathered``: the coalescing path, 4 workers each gathering 64
  concurrent ``cache.get(key)`` calls, against a hand-written coalescer; and
  ``get() x N gathered``: all keys at once (100 B only).

Reported: the ratio asynccache / hand-written (items/s over items/s, same run); the
README states the goals it is read against. A micro section times the per-item pieces
(codec decode vs pickle.loads, store key building) to attribute any gap. Throughput
only: per-item latency is in ``latency``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import asynccache as ac

from ..cli.progress import Progress
from . import plots
from ._common import (
    Session,
    Timing,
    UvloopRunner,
    batches_of,
    bench_redis_async,
    cpu_ratio,
    fail_if_incomplete,
    fmt_rate,
    fmt_size,
    markdown_table,
    progress_bar,
    quiet_gc,
    ratio,
    run_interleaved,
    run_workers,
    session_for,
)
from .peers import delete_keys, hand_written_mget, write_plain

BATCH = 64
IN_FLIGHT = 4

MICRO_SIZES = (100, 4096, 64 * 1024, 1 << 20)
# name, value size, keys: full, quick, smoke
WORKLOADS = (("100B", 100, (20_000, 4_000, 500)), ("64KiB", 64 * 1024, (2_000, 400, 64)))


def _checked(
    runner: UvloopRunner, name: str, expected: int, make: Callable[[], Coroutine[Any, Any, int]]
) -> Callable[[], None]:
    def case() -> None:
        fail_if_incomplete(name, runner.run(make()), expected)

    return case


async def _get_many_workers(cache: ac.AsyncKVCache, batches: Sequence[Sequence[str]]) -> int:
    async def one(batch: Sequence[str]) -> int:
        return len(await cache.get_many(batch))

    return await run_workers(batches, IN_FLIGHT, one)


async def _client_workers(
    client: Any, batches: Sequence[Sequence[bytes]], decode: Callable[[bytes, bytes], Any]
) -> int:
    """asynccache's RedisClient (bytes level, no core) with a given decoder: attribution.
    ``decode(blob, store_key)``: the codec binds every value to its key."""

    async def one(batch: Sequence[bytes]) -> int:
        blobs = await client.get_many(batch)
        return len({k: decode(b, k) for k, b in zip(batch, blobs) if b is not None})

    return await run_workers(batches, IN_FLIGHT, one)


async def _get_gathered_workers(cache: Any, batches: Sequence[Sequence[Any]]) -> int:
    async def one(batch: Sequence[Any]) -> int:
        values = await asyncio.gather(*(cache.get(k) for k in batch))
        return sum(v is not None for v in values)

    return await run_workers(batches, IN_FLIGHT, one)


def _unpickle(blob: bytes, _key: bytes) -> Any:
    return pickle.loads(blob)


class _HandWrittenCoalescer:
    """The floor for the coalescing path: get() futures of one loop tick -> one MGET.

    The least any autobatching get() must do: a future per call, one flush per tick,
    MGET, pickle.loads, set_result. The caller's asyncio.gather (a Task per call) is the
    same on both sides.
    """

    def __init__(self, r: Any) -> None:
        self.r = r
        self.pending: dict[bytes, list[asyncio.Future[Any]]] = {}
        self.scheduled = False
        self.tasks: set[asyncio.Task[None]] = set()

    async def get(self, key: bytes) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending.setdefault(key, []).append(fut)
        if not self.scheduled:
            self.scheduled = True
            loop.call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        pending, self.pending, self.scheduled = self.pending, {}, False
        task = asyncio.ensure_future(self._resolve(pending))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _resolve(self, pending: dict[bytes, list[asyncio.Future[Any]]]) -> None:
        keys = list(pending)
        values = await self.r.mget(keys)
        for key, value in zip(keys, values):
            decoded = None if value is None else pickle.loads(value)
            for fut in pending[key]:
                fut.set_result(decoded)


async def _get_all_gathered(cache: ac.AsyncKVCache, keys: Sequence[str]) -> int:
    values = await asyncio.gather(*(cache.get(k) for k in keys))
    return sum(v is not None for v in values)


def _per_call_ns(
    fn: Callable[[Any], Any], args: Sequence[Any], reps: int, loops: int = 20
) -> float:
    """Median over ``reps`` passes of the mean cost of ``fn(a)`` for ``a`` in ``args``."""
    samples = []
    for _ in range(reps + 1):  # the first pass is the warm-up
        started = time.thread_time()  # CPU time: steady even when the machine is busy
        for _ in range(loops):
            for a in args:
                fn(a)
        samples.append((time.thread_time() - started) / len(args) / loops * 1e9)
    samples = sorted(samples[1:])
    return samples[len(samples) // 2]


def _micro(cache: ac.AsyncKVCache, size: int, reps: int) -> dict[str, float]:
    """Per-item CPU costs of the pieces asynccache adds, measured without I/O.

    ``codec_decode_nocrc_ns``: the same values with ``Codec(checksum=False)``, which
    shows what the xxh3 checksum over the payload costs as values grow.
    """
    count = max(4, min(256, (4 << 20) // size))  # at most ~4 MiB of values
    loops = max(1, min(20, (4 << 20) // (count * size)))
    values = [os.urandom(size) for _ in range(count)]
    key = cache.key("micro")
    blobs = [cache.codec.encode(v, key) for v in values]
    nocrc = ac.Codec(checksum=False)
    nocrc_blobs = [nocrc.encode(v, key) for v in values]
    pickles = [pickle.dumps(v, protocol=5) for v in values]
    keys = [f"k{i}" for i in range(256)]
    return {
        "codec_decode_ns": _per_call_ns(functools.partial(cache.codec.decode, key=key), blobs,
                                        reps, loops),
        "codec_decode_nocrc_ns": _per_call_ns(functools.partial(nocrc.decode, key=key),
                                              nocrc_blobs, reps, loops),
        "pickle_loads_ns": _per_call_ns(pickle.loads, pickles, reps, loops),
        "store_key_ns": _per_call_ns(cache.key, keys, reps),
    }


# -------------------------------------------------------------------------------- run


def run(
    *, quick: bool, out_dir: Path, progress: bool, session: Session | None = None
) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc():
        store = s.redis_store()
        if store is None:
            return {"skipped": "needs a Redis-protocol store (redis or valkey)"}
        mode = s.mode_index
        results: dict[str, Any] = {
            "config": {
                "store": store.name,
                "server": store.label,
                "batch": BATCH,
                "in_flight": IN_FLIGHT,
                "reps": s.reps,
                "loop": "uvloop",
                "mode": s.mode,
            },
            "workloads": {},
        }
        client = ac.connect(store.url)
        cache = ac.AsyncKVCache(client, namespace=s.namespace("core"), ttl=s.ttl(store))
        runner = UvloopRunner()
        hw = bench_redis_async(store)
        bar = progress_bar(0, "core", s.progress)
        try:
            for label, size, counts in WORKLOADS:
                bar.describe(f"core {label}")
                results["workloads"][label] = _run_workload(
                    s, runner, cache, hw, store, label, size, counts[mode], bar
                )
            results["micro"] = {fmt_size(size): _micro(cache, size, s.reps) for size in MICRO_SIZES}
            results["cache_stats"] = cache.stats()
        finally:
            bar.close()
            runner.run(hw.aclose())
            runner.run(cache.aclose())
            runner.close()
    return results


def _run_workload(
    s: Session,
    runner: UvloopRunner,
    cache: ac.AsyncKVCache,
    hw: Any,
    store: Any,
    label: str,
    size: int,
    n: int,
    bar: Progress,
) -> dict[str, Any]:
    values = [os.urandom(size) for _ in range(n)]
    ac_keys = [f"{label}:{i}" for i in range(n)]
    hw_keys = [f"{s.namespace('core-hw', label)}:{i}".encode() for i in range(n)]
    for chunk in batches_of(list(zip(ac_keys, values)), 500):
        runner.run(cache.set_many(dict(chunk)))
    write_plain(
        store, [k.decode() for k in hw_keys], [pickle.dumps(v, 5) for v in values], s.ttl(store)
    )
    ac_batches = batches_of(ac_keys, BATCH)
    hw_batches = batches_of(hw_keys, BATCH)
    store_batches = batches_of([cache.key(k) for k in ac_keys], BATCH)
    client = cache.client

    cases: dict[str, Callable[[], None]] = {
        "hand-written MGET": _checked(
            runner, "hand-written", n, lambda: hand_written_mget(hw, hw_batches, IN_FLIGHT)
        ),
        # Attribution, layer by layer in the same shape: asynccache's RedisClient alone
        # (pool, timeouts), then with its codec, then the whole core.
        "  client.get_many + pickle.loads": _checked(
            runner, "client+pickle", n, lambda: _client_workers(client, hw_batches, _unpickle)
        ),
        "  client.get_many + codec.decode": _checked(
            runner,
            "client+codec",
            n,
            lambda: _client_workers(client, store_batches, cache.codec.decode),
        ),
        "asynccache get_many": _checked(
            runner, "get_many", n, lambda: _get_many_workers(cache, ac_batches)
        ),
    }
    if size <= 1024:  # the coalescing path: only for small values
        coalescer = _HandWrittenCoalescer(hw)
        cases["hand-written coalescing get() x64"] = _checked(
            runner, "hw get x64", n, lambda: _get_gathered_workers(coalescer, hw_batches)
        )
        cases["asynccache get() x64 gathered"] = _checked(
            runner, "get x64", n, lambda: _get_gathered_workers(cache, ac_batches)
        )
        cases["asynccache get() xN gathered"] = _checked(
            runner, "get xN", n, lambda: _get_all_gathered(cache, ac_keys)
        )
    timings = {name: Timing(name, n, size) for name in cases}
    bar.add_total(len(cases) * (s.reps + s.warmup))
    try:
        run_interleaved(cases, timings, s.reps, warmup=s.warmup, bar=bar)
    finally:
        delete_keys(store, [*hw_keys, *(cache.key(k) for k in ac_keys)])
    floor = timings["hand-written MGET"]
    out = {
        "value_bytes": size,
        "keys": n,
        "timings": {name: t.as_dict() for name, t in timings.items()},
        "ratios_vs_hand_written": {name: ratio(t, floor) for name, t in timings.items()},
        "cpu_ratios_vs_hand_written": {name: cpu_ratio(t, floor) for name, t in timings.items()},
    }
    if "hand-written coalescing get() x64" in timings:
        hw_get = timings["hand-written coalescing get() x64"]
        ac_get = timings["asynccache get() x64 gathered"]
        out["coalescing_ratio_vs_hand_written"] = ratio(ac_get, hw_get)
        out["coalescing_cpu_ratio_vs_hand_written"] = cpu_ratio(ac_get, hw_get)
    return out


# ------------------------------------------------------------------------------ report


def table(results: dict[str, Any]) -> str:
    if "skipped" in results:
        return f"### core\n\nskipped: {results['skipped']}\n"
    cfg = results["config"]
    out = [
        f"### get throughput on {cfg['server']}: batches of {cfg['batch']}, "
        f"{cfg['in_flight']} in flight, uvloop, median of {cfg['reps']}",
        "",
        "ratio: items/s over hand-written MGET's; CPU ratio: hand-written's CPU per item "
        "over this one's (> 1: leaner).",
        "",
    ]
    rows = []
    for label, w in results["workloads"].items():
        for name, t in w["timings"].items():
            rows.append(
                [
                    f"{label} {name.strip()}",
                    f"{w['keys']:,}",
                    f"{t['median_s'] * 1e3:.1f}",
                    fmt_rate(t["items_per_s"]),
                    fmt_rate(t["mb_per_s"]),
                    f"{w['ratios_vs_hand_written'][name]:.2f}",
                    f"{t['cpu_us_per_item']:.2f}",
                    f"{w['cpu_ratios_vs_hand_written'][name]:.2f}",
                ]
            )
    out.append(
        markdown_table(
            ["case", "items", "ms", "items/s", "MB/s", "ratio", "CPU µs/item", "CPU ratio"], rows
        )
    )
    out += ["", "Per-item CPU (ns, thread time, no I/O):", ""]
    out.append(
        markdown_table(
            ["value", "codec.decode", "codec.decode, checksum=False", "pickle.loads", "cache.key"],
            [
                [
                    label,
                    f"{m['codec_decode_ns']:.0f}",
                    f"{m['codec_decode_nocrc_ns']:.0f}",
                    f"{m['pickle_loads_ns']:.0f}",
                    f"{m['store_key_ns']:.0f}",
                ]
                for label, m in results["micro"].items()
            ],
        )
    )
    out += ["", "asynccache get_many ÷ hand-written MGET, same run:", ""]
    for label, w in results["workloads"].items():
        r = w["ratios_vs_hand_written"]["asynccache get_many"]
        c = w["cpu_ratios_vs_hand_written"]["asynccache get_many"]
        line = f"- {label}: wall {r:.2f}; client CPU efficiency {c:.2f}"
        if "coalescing_ratio_vs_hand_written" in w:
            line += (
                f"; coalescing get() x64 vs hand-written coalescer: wall "
                f"{w['coalescing_ratio_vs_hand_written']:.2f}, CPU "
                f"{w['coalescing_cpu_ratio_vs_hand_written']:.2f}"
            )
        out.append(line)
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    if "skipped" in results:
        return []
    groups = {
        f"{label} {kind}": {name.strip(): w[key][name] for name in w["timings"]}
        for label, w in results["workloads"].items()
        for kind, key in (
            ("items/s", "ratios_vs_hand_written"),
            ("CPU", "cpu_ratios_vs_hand_written"),
        )
    }
    return [
        plots.bars(
            out_dir / "core_ratios.png",
            groups,
            title="AsyncKVCache vs hand-written redis.asyncio MGET (1.0 = equal)",
            xlabel="ratio to hand-written MGET (> 1: faster / leaner)",
        )
    ]
