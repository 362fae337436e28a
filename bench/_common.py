"""Shared helpers for the benchmarks: CLI, timing, machine description, baselines, output.

Every number a benchmark prints is the median of at least five timed repetitions taken
after warm-up runs, and every ratio compares two measurements of the same run (same
process, same private server, repetitions interleaved so that drift hits both sides).
Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import json
import os
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
import uvloop

PACKAGES = ("asynccache", "redis", "hiredis", "uvloop", "numpy", "torch", "pyinstrument",
            "py-spy")


# --------------------------------------------------------------------------- CLI / output


def parse_args(description: str, argv: Sequence[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(parser)
    parser.add_argument("--quick", action="store_true",
                        help="smaller workloads and fewer repetitions (< 40 s)")
    parser.add_argument("--out", default="bench-results", type=Path,
                        help="directory for the JSON result (default: bench-results/)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per measurement (>= 5; default 9, quick 5)")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 5 if args.quick else 9
    args.reps = max(5, args.reps)
    return args


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(server: Any) -> dict[str, Any]:
    """CPU, cores, Python, store server and package versions: the context of every number."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "server_kind": getattr(server, "kind", "redis"),
        "server_version": getattr(server, "version", ""),
        "server_transport": "tcp 127.0.0.1",
        "load_average_at_start": load_average(),
        "packages": versions,
    }


def load_average() -> list[float] | None:
    """1/5/15-minute load: above the core count, other processes shared the CPUs."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return None


def machine_line(m: dict[str, Any]) -> str:
    return (f"{m['cpu_model']}, {m['cpus_usable']} cores, Python {m['python']}, "
            f"{m['server_kind']}-server {m['server_version']} ({m['server_transport']}), "
            f"redis-py {m['packages']['redis']}, hiredis {m['packages']['hiredis']}, "
            f"uvloop {m['packages']['uvloop']}")


def write_json(out_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{name}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  " + "  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(headers, widths))))
    print("  " + "  ".join("-" * w for w in widths))
    for r in cells:
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value >= 100_000:
            return f"{value:,.0f}"
        if value >= 100:
            return f"{value:,.1f}"
        return f"{value:.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


# --------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Wall times (seconds) of the timed repetitions of one measurement."""

    name: str
    items: int
    item_bytes: int = 0
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # this process, all threads

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def items_per_s(self) -> float:
        return self.items / self.median

    @property
    def cpu_us_per_item(self) -> float:
        """Median CPU time of this process per item: robust when other processes
        compete for the CPUs (wall time is not), blind to the server's share."""
        return statistics.median(self.cpu_times) / self.items * 1e6

    @property
    def mb_per_s(self) -> float:
        return self.items * self.item_bytes / self.median / 1e6

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "items": self.items,
            "item_bytes": self.item_bytes,
            "reps": len(self.times),
            "median_s": self.median,
            "min_s": min(self.times),
            "max_s": max(self.times),
            "items_per_s": self.items_per_s,
            "mb_per_s": self.mb_per_s,
            "cpu_us_per_item": self.cpu_us_per_item,
            "times_s": self.times,
            "cpu_times_s": self.cpu_times,
        }


def run_interleaved(cases: dict[str, Callable[[], Any]], timings: dict[str, Timing],
                    reps: int, warmup: int = 1) -> None:
    """Warm each case up, then time them round-robin ``reps`` times (A B C A B C ...).

    Round-robin rather than case after case, so that slow drift on a shared machine
    (CPU frequency, a noisy neighbour) lands on every case alike.
    """
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    for _ in range(reps):
        for name, fn in cases.items():
            gc.collect()
            cpu = time.process_time()
            started = time.perf_counter()
            fn()
            timings[name].times.append(time.perf_counter() - started)
            timings[name].cpu_times.append(time.process_time() - cpu)


def ratio(a: Timing, b: Timing) -> float:
    """Throughput of ``a`` relative to ``b`` (> 1: ``a`` is faster)."""
    return a.items_per_s / b.items_per_s


def cpu_ratio(a: Timing, b: Timing) -> float:
    """CPU efficiency of ``a`` relative to ``b``: b's CPU per item / a's (> 1: a is leaner)."""
    return b.cpu_us_per_item / a.cpu_us_per_item


# --------------------------------------------------------------------------- event loop


class UvloopRunner:
    """One uvloop event loop in the calling thread, reused for every measurement."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        asyncio.set_event_loop(None)


def batches_of(seq: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [seq[i : i + size] for i in range(0, len(seq), size)]


async def run_workers(batches: Sequence[Any], in_flight: int,
                      one: Callable[[Any], Awaitable[int]]) -> int:
    """Run ``one(batch)`` over ``batches`` with ``in_flight`` of them at a time.

    ``in_flight`` workers pull the next batch from a shared iterator, so exactly that many
    requests are outstanding until the batches run out. Returns the sum of the results.
    """
    it = iter(batches)
    total = 0

    async def worker() -> None:
        nonlocal total
        for batch in it:
            n = await one(batch)  # not `total += await ...`: that reads total before awaiting
            total += n

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return total


# --------------------------------------------------------------------------- baselines


def hw_key(prefix: str, i: int) -> bytes:
    return f"{prefix}:{i}".encode()


def store_pickled(url_host: str, port: int, keys: Sequence[bytes],
                  values: Sequence[Any]) -> None:
    """Write ``pickle.dumps(value)`` under ``keys`` with the sync client (setup only)."""
    r = redis.Redis(host=url_host, port=port)
    try:
        for chunk in batches_of(list(zip(keys, values)), 500):
            r.mset({k: pickle.dumps(v, protocol=5) for k, v in chunk})
    finally:
        r.close()


def hand_written_redis(host: str, port: int) -> aioredis.Redis:
    """The floor's client: redis.asyncio with its default pool (hiredis parser if present)."""
    return aioredis.Redis(host=host, port=port)


async def hand_written_mget(r: aioredis.Redis, key_batches: Sequence[Sequence[bytes]],
                            in_flight: int = 4) -> int:
    """The fair floor: MGET per batch, ``in_flight`` requests outstanding, pickle.loads.

    It does what asynccache's ``get_many`` does minus the codec header/checksum,
    namespacing, stats and misses bookkeeping: a dict of decoded hits per batch.
    """
    loads = pickle.loads

    async def one(batch: Sequence[bytes]) -> int:
        values = await r.mget(batch)
        hits = {k: loads(v) for k, v in zip(batch, values) if v is not None}
        return len(hits)

    return await run_workers(key_batches, in_flight, one)


def naive_sync_get(r: redis.Redis, keys: Sequence[bytes]) -> int:
    """One synchronous GET round trip per item, then pickle.loads: what a naive cache does."""
    loads = pickle.loads
    get = r.get
    n = 0
    for k in keys:
        v = get(k)
        if v is not None:
            loads(v)
            n += 1
    return n


def hiredis_available() -> bool:
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


def fail_if_incomplete(what: str, got: int, expected: int) -> None:
    """A benchmark that read fewer items than planned measured something else: stop."""
    if got != expected:
        sys.exit(f"{what}: read {got} items, expected {expected}; the numbers would be wrong")
