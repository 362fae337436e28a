"""``AsyncKVCache.get_many`` throughput against a hand-written ``redis.asyncio`` floor.

    python -m bench.bench_core [--quick] [--out DIR] [--reps N]

One private redis-server (127.0.0.1 TCP) for the whole run. Workload: bytes values of
100 B (20,000 keys) and 64 KiB (2,000 keys), read in batches of 64 keys with 4 requests
in flight, on uvloop, in the main thread:

* ``asynccache get_many``: 4 workers, each ``await cache.get_many(64 keys)`` in turn.
* ``hand-written MGET``: the same shape with ``redis.asyncio.Redis`` (hiredis), ``MGET``
  of 64 keys and ``pickle.loads`` of every hit into a dict. Values are stored with plain
  ``pickle.dumps``. It is the fair floor: asynccache's work minus its codec header and
  checksum, namespacing and stats.
* ``asynccache get() x64 gathered``: the coalescing path, 4 workers each gathering 64
  concurrent ``cache.get(key)`` calls; and ``get() x N gathered``: all keys at once.

The ratio asynccache / hand-written (items/s over items/s, same run) has a target of
>= 0.8. A micro section times the per-item pieces (codec decode vs pickle.loads, store
key building) to attribute any gap.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import asynccache as ac
from asynccache.servers import start_redis

from ._common import (
    Timing,
    UvloopRunner,
    batches_of,
    cpu_ratio,
    fail_if_incomplete,
    hand_written_mget,
    hand_written_redis,
    hiredis_available,
    hw_key,
    load_average,
    machine_info,
    machine_line,
    parse_args,
    print_table,
    ratio,
    run_interleaved,
    run_workers,
    store_pickled,
    write_json,
)

BATCH = 64
IN_FLIGHT = 4
TARGET_RATIO = 0.8

# name, value size, keys (full run), keys (quick run)
WORKLOADS = (("100B", 100, 20_000, 6_000), ("64KiB", 64 * 1024, 2_000, 600))


def _checked(runner: UvloopRunner, name: str, expected: int,
             make: Callable[[], Coroutine[Any, Any, int]]) -> Callable[[], None]:
    def case() -> None:
        fail_if_incomplete(name, runner.run(make()), expected)

    return case


async def _get_many_workers(cache: ac.AsyncKVCache, batches: Sequence[Sequence[str]]) -> int:
    async def one(batch: Sequence[str]) -> int:
        return len(await cache.get_many(batch))

    return await run_workers(batches, IN_FLIGHT, one)


async def _client_workers(client: Any, batches: Sequence[Sequence[bytes]],
                          decode: Callable[[bytes], Any]) -> int:
    """asynccache's RedisClient (bytes level, no core) with a given decoder: attribution."""
    async def one(batch: Sequence[bytes]) -> int:
        blobs = await client.get_many(batch)
        return len({k: decode(b) for k, b in zip(batch, blobs) if b is not None})

    return await run_workers(batches, IN_FLIGHT, one)


async def _get_gathered_workers(cache: Any, batches: Sequence[Sequence[Any]]) -> int:
    async def one(batch: Sequence[Any]) -> int:
        values = await asyncio.gather(*(cache.get(k) for k in batch))
        return sum(v is not None for v in values)

    return await run_workers(batches, IN_FLIGHT, one)


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


def _per_call_ns(fn: Callable[[Any], Any], args: Sequence[Any], reps: int) -> float:
    """Median over ``reps`` passes of the mean cost of ``fn(a)`` for ``a`` in ``args``."""
    samples = []
    for _ in range(reps + 1):  # the first pass is the warm-up
        started = time.thread_time()  # CPU time: steady even when the machine is busy
        for _ in range(20):
            for a in args:
                fn(a)
        samples.append((time.thread_time() - started) / len(args) / 20 * 1e9)
    samples = sorted(samples[1:])
    return samples[len(samples) // 2]


def _micro(cache: ac.AsyncKVCache, size: int, reps: int) -> dict[str, float]:
    """Per-item CPU costs of the pieces asynccache adds, measured without I/O."""
    values = [os.urandom(size) for _ in range(256)]
    blobs = [cache.codec.encode(v) for v in values]
    pickles = [pickle.dumps(v, protocol=5) for v in values]
    keys = [f"k{i}" for i in range(256)]
    return {
        "codec_decode_ns": _per_call_ns(cache.codec.decode, blobs, reps),
        "pickle_loads_ns": _per_call_ns(pickle.loads, pickles, reps),
        "store_key_ns": _per_call_ns(cache.key, keys, reps),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("AsyncKVCache.get_many vs a hand-written redis.asyncio MGET loop", argv)
    started = time.perf_counter()
    results: dict[str, Any] = {"workloads": {}}
    with start_redis() as server:
        machine = machine_info(server)
        machine["hiredis_parser_active"] = hiredis_available()
        print(f"machine: {machine_line(machine)}")
        if not machine["hiredis_parser_active"]:
            print("warning: hiredis is not active; both sides use the pure-Python parser")
        client = ac.connect(server.url)
        cache = ac.AsyncKVCache(client, namespace="bench-core")
        runner = UvloopRunner()
        hw = hand_written_redis(server.host, server.port)
        try:
            for label, size, full_n, quick_n in WORKLOADS:
                n = quick_n if args.quick else full_n
                results["workloads"][label] = _run_workload(
                    runner, cache, hw, server, label, size, n, args.reps,
                    warmup=1 if args.quick else 2)
            micro = {label: _micro(cache, size, args.reps) for label, size, _, _ in WORKLOADS}
            results["micro"] = micro
            results["cache_stats"] = cache.stats()
        finally:
            runner.run(hw.aclose())
            runner.run(cache.aclose())
            runner.close()
    machine["load_average_at_end"] = load_average()
    _report(results, machine, args)
    results["elapsed_s"] = time.perf_counter() - started

    path = write_json(args.out, "bench_core", {
        "benchmark": "bench_core",
        "machine": machine,
        "config": {"batch": BATCH, "in_flight": IN_FLIGHT, "reps": args.reps,
                   "quick": args.quick, "loop": "uvloop", "target_ratio": TARGET_RATIO},
        "results": results,
    })
    print(f"\nwrote {path}  ({results['elapsed_s']:.1f} s)")
    return 0


def _run_workload(runner: UvloopRunner, cache: ac.AsyncKVCache, hw: Any, server: Any,
                  label: str, size: int, n: int, reps: int, warmup: int) -> dict[str, Any]:
    values = [os.urandom(size) for _ in range(n)]
    ac_keys = [f"{label}:{i}" for i in range(n)]
    hw_keys = [hw_key(f"hw-{label}", i) for i in range(n)]
    for chunk in batches_of(list(zip(ac_keys, values)), 500):
        runner.run(cache.set_many(dict(chunk)))
    store_pickled(server.host, server.port, hw_keys, values)
    ac_batches = batches_of(ac_keys, BATCH)
    hw_batches = batches_of(hw_keys, BATCH)
    store_batches = batches_of([cache.key(k) for k in ac_keys], BATCH)
    client = cache.client

    cases: dict[str, Callable[[], None]] = {
        "hand-written MGET": _checked(runner, "hand-written", n,
                                      lambda: hand_written_mget(hw, hw_batches, IN_FLIGHT)),
        # Attribution, layer by layer in the same shape: asynccache's RedisClient alone
        # (pool, timeouts), then with its codec, then the whole core.
        "  client.get_many + pickle.loads": _checked(
            runner, "client+pickle", n,
            lambda: _client_workers(client, hw_batches, pickle.loads)),
        "  client.get_many + codec.decode": _checked(
            runner, "client+codec", n,
            lambda: _client_workers(client, store_batches, cache.codec.decode)),
        "asynccache get_many": _checked(runner, "get_many", n,
                                        lambda: _get_many_workers(cache, ac_batches)),
    }
    if size <= 1024:  # the coalescing path: only for small values, as asked
        coalescer = _HandWrittenCoalescer(hw)
        cases["hand-written coalescing get() x64"] = _checked(
            runner, "hw get x64", n, lambda: _get_gathered_workers(coalescer, hw_batches))
        cases["asynccache get() x64 gathered"] = _checked(
            runner, "get x64", n, lambda: _get_gathered_workers(cache, ac_batches))
        cases["asynccache get() xN gathered"] = _checked(
            runner, "get xN", n, lambda: _get_all_gathered(cache, ac_keys))
    timings = {name: Timing(name, n, size) for name in cases}
    run_interleaved(cases, timings, reps, warmup=warmup)
    floor = timings["hand-written MGET"]
    out = {
        "value_bytes": size,
        "keys": n,
        "timings": {name: t.as_dict() for name, t in timings.items()},
        "ratios_vs_hand_written": {name: ratio(t, floor) for name, t in timings.items()},
        "cpu_ratios_vs_hand_written": {name: cpu_ratio(t, floor)
                                       for name, t in timings.items()},
    }
    if "hand-written coalescing get() x64" in timings:
        hw_get = timings["hand-written coalescing get() x64"]
        ac_get = timings["asynccache get() x64 gathered"]
        out["coalescing_ratio_vs_hand_written"] = ratio(ac_get, hw_get)
        out["coalescing_cpu_ratio_vs_hand_written"] = cpu_ratio(ac_get, hw_get)
    return out


def _report(results: dict[str, Any], machine: dict[str, Any], args: Any) -> None:
    rows = []
    for label, w in results["workloads"].items():
        for name, t in w["timings"].items():
            r = w["ratios_vs_hand_written"][name]
            c = w["cpu_ratios_vs_hand_written"][name]
            rows.append([f"{label:>5}  {name}", w["keys"], t["median_s"] * 1e3,
                         t["items_per_s"], t["mb_per_s"], f"{r:.2f}",
                         t["cpu_us_per_item"], f"{c:.2f}"])
    print_table(f"get throughput, batches of {BATCH}, {IN_FLIGHT} in flight, uvloop, "
                f"median of {args.reps}  (ratio: items/s / hand-written's; cpu ratio: "
                "hand-written's client CPU per item / this one's)",
                ["case", "items", "ms", "items/s", "MB/s", "ratio", "cpu us/item",
                 "cpu ratio"], rows)
    mrows = [[label, m["codec_decode_ns"], m["pickle_loads_ns"], m["store_key_ns"]]
             for label, m in results["micro"].items()]
    print_table("per-item CPU (ns, thread time, no I/O)",
                ["value", "codec.decode", "pickle.loads", "cache.key"], mrows)
    print(f"\ntargets (asynccache get_many / hand-written >= {TARGET_RATIO}):")
    for label, w in results["workloads"].items():
        r = w["ratios_vs_hand_written"]["asynccache get_many"]
        c = w["cpu_ratios_vs_hand_written"]["asynccache get_many"]
        verdict = "met" if r >= TARGET_RATIO else "MISSED"
        print(f"  {label:>5}: wall {r:.2f} {verdict} ({(r / TARGET_RATIO - 1) * 100:+.0f}% vs "
              f"target); client CPU efficiency {c:.2f}")
        if "coalescing_ratio_vs_hand_written" in w:
            print(f"         coalescing get() x64 vs hand-written coalescer: wall "
                  f"{w['coalescing_ratio_vs_hand_written']:.2f}, CPU "
                  f"{w['coalescing_cpu_ratio_vs_hand_written']:.2f}")
    load = machine.get("load_average_at_start")
    if load and load[0] > (machine.get("cpus_usable") or 1):
        print(f"note: load average {load} exceeds the {machine['cpus_usable']} usable cores: "
              "other processes shared the CPUs, wall-clock ratios are noisy; the CPU "
              "ratios are the steadier signal")


if __name__ == "__main__":
    sys.exit(main())
