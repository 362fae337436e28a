"""Shared pieces of the benchmarks: stores, machine description, timing, tables.

Every number a benchmark reports is the median over timed repetitions taken after
warm-up runs, and every ratio compares two measurements of the same run (same process,
same server, same values, repetitions interleaved so that drift hits both sides).
Nothing here asserts on timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.metadata
import math
import os
import pickle
import platform
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import redis
import redis.asyncio as aioredis
import uvloop

from ..cli.progress import Progress
from ..errors import CacheError, ConfigError
from ..testing import servers

PACKAGES = (
    "asynccache",
    "redis",
    "hiredis",
    "uvloop",
    "numpy",
    "torch",
    "aiomcache",
    "aiocache",
    "pymemcache",
    "matplotlib",
    "tqdm",
    "py-spy",
    "pyinstrument",
)
STORES = ("redis", "valkey", "memcached")
MODES = ("full", "quick", "smoke")
#: timed repetitions per measurement (each figure is their median)
REPS = {"full": 7, "quick": 5, "smoke": 2}
#: the values a benchmark writes into somebody else's store (a --url-* store) expire
URL_TTL = 3600.0
#: memcached started by the benchmark: enough room and a 2 MiB item limit, so that
#: 1 MiB values (plus a pickle header) are stored whole by every client
MEMCACHED_MEMORY_MB = 1024
MEMCACHED_ITEM_SIZE = 2 * 1024 * 1024


class BenchError(CacheError):
    """A benchmark measured something other than what it meant to (a bug or a bad store)."""


class Skipped(Exception):
    """Raised by a benchmark's ``run`` that cannot run on this machine (a program it
    drives is not installed); the message says what to install. Recorded as skipped."""


# ------------------------------------------------------------------------------- stores


@dataclass(frozen=True)
class Store:
    """One store a run reads from: how to reach it and what it is."""

    name: str  # "redis", "valkey" or "memcached": the slot it fills in the run
    protocol: str  # "redis" or "memcached"
    url: str  # an asynccache URL
    host: str
    port: int
    kind: str  # what answered: redis, valkey or memcached
    version: str
    private: bool  # started by this run (else given with --url-*)
    db: int = 0
    username: str | None = None
    password: str | None = None
    item_size: int | None = None  # memcached's largest item

    @property
    def safe_url(self) -> str:
        if self.password is None:
            return self.url
        return self.url.replace(f":{self.password}@", ":***@", 1)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.version}".strip()

    def at(self, host: str, port: int) -> Store:
        """The same store reached at another address (through a proxy)."""
        parts = urlsplit(self.url)
        userinfo, _, _ = parts.netloc.rpartition("@")
        netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
        return replace(self, host=host, port=port, url=parts._replace(netloc=netloc).geturl())

    def fits(self, blob_size: int) -> bool:
        """Whether every peer can store a value of ``blob_size`` bytes whole."""
        return self.item_size is None or blob_size + 1024 <= self.item_size


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _check_loopback(name: str, host: str) -> None:
    if host not in LOOPBACK:
        raise ConfigError(
            f"--url-{name}: the benchmarks only talk to stores on this machine "
            f"(127.0.0.1), not {host!r}: publish the server's port on 127.0.0.1"
        )


def _redis_store(name: str, url: str, private: bool) -> Store:
    parts = urlsplit(url)
    if parts.scheme != "redis" or not parts.hostname:
        raise ConfigError(f"--url-{name} takes a redis://host:port/db URL, not {url!r}")
    _check_loopback(name, parts.hostname)
    db = int(parts.path.strip("/") or 0)
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        info = client.info("server")
    except redis.RedisError as exc:
        raise ConfigError(f"cannot reach the {name} store at {parts.hostname}: {exc}") from exc
    finally:
        client.close()
    kind = "valkey" if "valkey_version" in info or info.get("server_name") == "valkey" else "redis"
    return Store(
        name=name,
        protocol="redis",
        url=url,
        host=parts.hostname,
        port=parts.port or 6379,
        kind=kind,
        version=str(info.get("valkey_version") or info.get("redis_version", "")),
        private=private,
        db=db,
        username=parts.username or None,
        password=parts.password,
    )


def _memcached_store(url: str, private: bool) -> Store:
    from pymemcache.client.base import (
        Client as PymemcacheClient,
    )

    parts = urlsplit(url)
    if parts.scheme != "memcached" or "," in parts.netloc or not parts.hostname:
        raise ConfigError(f"--url-memcached takes one memcached://host:port, not {url!r}")
    host, port = parts.hostname, parts.port or 11211
    _check_loopback("memcached", host)
    client = PymemcacheClient((host, port), connect_timeout=5, timeout=5)
    try:
        version = client.version().decode()
        settings = client.stats("settings")
    except Exception as exc:  # pymemcache errors, OSError
        raise ConfigError(f"cannot reach memcached at {host}:{port}: {exc}") from exc
    finally:
        client.close()
    item_size = int(settings.get(b"item_size_max", 1024 * 1024))
    query = dict(parse_qsl(parts.query))
    if "item_size" not in query:  # tell asynccache the server's limit (it chunks above it)
        sep = "&" if parts.query else "?"
        url = f"{url}{sep}item_size={item_size}"
    return Store(
        name="memcached",
        protocol="memcached",
        url=url,
        host=host,
        port=port,
        kind="memcached",
        version=version,
        private=private,
        item_size=item_size,
    )


def _start_private(name: str, stack: contextlib.ExitStack) -> Store:
    if name == "memcached":
        server: servers.LocalServer = servers.start_memcached(
            memory_mb=MEMCACHED_MEMORY_MB, item_size=f"{MEMCACHED_ITEM_SIZE // 1024}k"
        )
        stack.callback(server.stop)
        return _memcached_store(f"{server.url}?item_size={MEMCACHED_ITEM_SIZE}", private=True)
    server = servers.start_redis(prefer=name)  # "redis": redis-server; "valkey": valkey
    stack.callback(server.stop)
    return _redis_store(name, server.url, private=True)


# ----------------------------------------------------------------------------- session


@dataclass
class Session:
    """What one CLI run shares between its benchmark modules."""

    mode: str  # "full", "quick" or "smoke"
    reps: int
    progress: bool
    stores: dict[str, Store]
    machine: dict[str, Any]
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    notes: list[str] = field(default_factory=list)

    @property
    def warmup(self) -> int:
        return 1

    @property
    def mode_index(self) -> int:
        """0, 1, 2 for full, quick, smoke: settings are ``(full, quick, smoke)`` tuples."""
        return MODES.index(self.mode)

    def ttl(self, store: Store) -> float | None:
        """Values written into a store we did not start expire; ours are thrown away."""
        return None if store.private else URL_TTL

    def redis_store(self) -> Store | None:
        """The first Redis-protocol store (redis, else valkey)."""
        return next((s for s in self.stores.values() if s.protocol == "redis"), None)

    def namespace(self, *parts: object) -> str:
        return "-".join(["bench", self.token, *map(str, parts)])


@contextlib.contextmanager
def open_session(
    mode: str,
    *,
    progress: bool,
    stores: Sequence[str] = STORES,
    urls: Mapping[str, str] | None = None,
    reps: int | None = None,
    required: Sequence[str] = (),
) -> Iterator[Session]:
    """Start (or reach, for ``urls``) the stores; stop what was started on exit.

    A store in ``required`` that cannot be started is an error; any other is left out
    of the run with a note (a machine without valkey still gets the other numbers).
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, not {mode!r}")
    urls = dict(urls or {})
    notes = []
    with contextlib.ExitStack() as stack:
        found: dict[str, Store] = {}
        for name in stores:
            url = urls.get(name)
            if url is not None:
                found[name] = (
                    _memcached_store(url, private=False)
                    if name == "memcached"
                    else _redis_store(name, url, private=False)
                )
                continue
            try:
                found[name] = _start_private(name, stack)
            except servers.ServerNotFound as exc:
                if name in required:
                    raise
                notes.append(f"{name}: not measured ({exc})")
        if not found:
            raise ConfigError("no store to benchmark: " + "; ".join(notes))
        session = Session(
            mode=mode,
            reps=reps or REPS[mode],
            progress=progress,
            stores=found,
            machine=machine_info(found),
            notes=notes,
        )
        yield session
        session.machine["load_average_at_end"] = load_average()


@contextlib.contextmanager
def session_for(session: Session | None, *, quick: bool, progress: bool) -> Iterator[Session]:
    """The CLI's session, or a private one (every store) for a module run on its own."""
    if session is not None:
        yield session
        return
    with open_session("quick" if quick else "full", progress=progress) as own:
        yield own


# ----------------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    """1/5/15-minute load: above the core count, other processes shared the CPUs."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return None


def hiredis_available() -> bool:
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


def machine_info(stores: Mapping[str, Store]) -> dict[str, Any]:
    """CPU, cores, memory, Python, store servers and package versions."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        memory_gib = None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": memory_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "event_loop": "uvloop",
        "hiredis_parser_active": hiredis_available(),
        "servers": {
            name: {
                "kind": s.kind,
                "version": s.version,
                "url": s.safe_url,
                "private": s.private,
                "transport": "tcp loopback" if s.host in ("127.0.0.1", "localhost") else "tcp",
                "item_size": s.item_size,
            }
            for name, s in stores.items()
        },
        "load_average_at_start": load_average(),
        "packages": versions,
    }


def machine_line(m: Mapping[str, Any]) -> str:
    """One line that says what the numbers were measured on."""
    stores = ", ".join(
        f"{s['kind']} {s['version']}" + ("" if s["private"] else " (given URL)")
        for s in m.get("servers", {}).values()
    )
    memory = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    load = m.get("load_average_at_start")
    busy = f"; load average {load[0]:g} at start" if load else ""
    pk = m.get("packages", {})
    return (
        f"{m['cpu_model']}, {m['cpus_usable']} cores{memory}, {m['platform']}, "
        f"Python {m['python']}; {stores} on 127.0.0.1 TCP; redis-py {pk.get('redis')}, "
        f"hiredis {pk.get('hiredis')}, uvloop {pk.get('uvloop')}{busy}"
    )


def busy_note(m: Mapping[str, Any]) -> str | None:
    load = m.get("load_average_at_start")
    if load and load[0] > (m.get("cpus_usable") or 1):
        return (
            f"load average {load[0]:g} exceeded the {m['cpus_usable']} usable cores at start: "
            "other processes shared the CPUs, so wall-clock figures are noisy (ratios within "
            "the run are the steadier signal)"
        )
    return None


# ------------------------------------------------------------------------------- values


def make_values(size: int, n: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct random ``bytes`` of ``size`` (the same for every client of a run)."""
    rng = random.Random(seed * 1_000_003 + size)
    return [rng.randbytes(size) for _ in range(n)]


def pickled(values: Sequence[Any]) -> list[bytes]:
    return [pickle.dumps(v, protocol=5) for v in values]


def batches_of(seq: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [seq[i : i + size] for i in range(0, len(seq), size)]


def chunks_by_bytes(
    items: Sequence[tuple[Any, bytes]], budget: int = 8 << 20
) -> Iterator[list[tuple[Any, bytes]]]:
    """Consecutive runs of ``(key, blob)`` pairs of at most ~``budget`` bytes (setup I/O)."""
    chunk: list[tuple[Any, bytes]] = []
    size = 0
    for key, blob in items:
        chunk.append((key, blob))
        size += len(blob)
        if size >= budget or len(chunk) >= 1000:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# --------------------------------------------------------------------------- event loop


class UvloopRunner:
    """One uvloop event loop in the calling thread, reused for every measurement."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


async def run_workers(
    batches: Sequence[Any], in_flight: int, one: Callable[[Any], Awaitable[int]]
) -> int:
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


# ------------------------------------------------------- throughput timing (core, datapipe)


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


def run_interleaved(
    cases: Mapping[str, Callable[[], Any]],
    timings: Mapping[str, Timing],
    reps: int,
    warmup: int = 1,
    bar: Progress | None = None,
) -> None:
    """Warm each case up, then time them round-robin ``reps`` times (A B C A B C ...).

    Round-robin rather than case after case, so that slow drift on a shared machine
    (CPU frequency, a noisy neighbour) lands on every case alike. ``bar`` counts every
    run and shows the repetition under way.
    """
    if bar is not None:
        bar.rep(0, reps)
    for fn in cases.values():
        for _ in range(warmup):
            fn()
            if bar is not None:
                bar.update()
    for rep in range(1, reps + 1):
        if bar is not None:
            bar.rep(rep, reps)
        for name, fn in cases.items():
            gc.collect()
            cpu = time.process_time()
            started = time.perf_counter()
            fn()
            timings[name].times.append(time.perf_counter() - started)
            timings[name].cpu_times.append(time.process_time() - cpu)
            if bar is not None:
                bar.update()


def ratio(a: Timing, b: Timing) -> float:
    """Throughput of ``a`` relative to ``b`` (> 1: ``a`` is faster)."""
    return a.items_per_s / b.items_per_s


def cpu_ratio(a: Timing, b: Timing) -> float:
    """CPU efficiency of ``a`` relative to ``b``: b's CPU per item / a's (> 1: a is leaner)."""
    return b.cpu_us_per_item / a.cpu_us_per_item


def fail_if_incomplete(what: str, got: int, expected: int) -> None:
    """A benchmark that read fewer items than planned measured something else: stop."""
    if got != expected:
        raise BenchError(
            f"{what}: read {got} items, expected {expected}; the numbers would be wrong"
        )


# ----------------------------------------------------- latency timing (latency, network)


@dataclass
class Rep:
    """What one repetition of a case saw at the consumer.

    One-item reads fill ``item_s`` (each call); batch reads fill ``batch_s`` and
    ``batch_sizes`` (each awaited or returned batch).
    """

    items: int
    item_s: list[float] | None = None
    batch_s: list[float] | None = None
    batch_sizes: list[int] | None = None


@dataclass
class Case:
    """One way of reading ``items`` values, timed as a whole and per item/batch."""

    name: str
    role: str  # "asynccache", "dict", "naive", "floor" (hand-written batched), "aiocache"
    items: int
    item_bytes: int
    batch: int  # items per batch (one-item reads: the group size for per-batch latency)
    fn: Callable[[], Rep]
    params: dict[str, Any] = field(default_factory=dict)


def time_items(
    get: Callable[[int], Any], indices: Sequence[int], work: Callable[[], Any] | None = None
) -> Rep:
    """``get(i)`` for every index, each call timed; ``work()`` after each, untimed."""
    clock = time.perf_counter
    lat = [0.0] * len(indices)
    n = 0
    for j, i in enumerate(indices):
        started = clock()
        value = get(i)
        lat[j] = clock() - started
        if value is not None:
            n += 1
        if work is not None:
            work()
    return Rep(n, item_s=lat)


def time_batches(
    get_batch: Callable[[Sequence[int]], Sequence[Any]], batches: Sequence[Sequence[int]]
) -> Rep:
    """``get_batch(b)`` for every batch, each call timed; counts non-None values."""
    clock = time.perf_counter
    lat = []
    n = 0
    for batch in batches:
        started = clock()
        values = get_batch(batch)
        lat.append(clock() - started)
        n += sum(1 for v in values if v is not None)
    return Rep(n, batch_s=lat, batch_sizes=[len(b) for b in batches])


async def time_async_batches(
    one: Callable[[Sequence[Any]], Awaitable[int]], batches: Sequence[Sequence[Any]], in_flight: int
) -> Rep:
    """``await one(batch)`` (returns the hits) with ``in_flight`` batches outstanding."""
    clock = time.perf_counter
    lat: list[float] = []
    sizes: list[int] = []

    async def timed(batch: Sequence[Any]) -> int:
        started = clock()
        n = await one(batch)
        lat.append(clock() - started)
        sizes.append(len(batch))
        return n

    n = await run_workers(batches, in_flight, timed)
    return Rep(n, batch_s=lat, batch_sizes=sizes)


_QUANTILES = (50, 95, 99)


def _percentiles(samples_us: Any) -> dict[str, float]:
    import numpy as np

    if len(samples_us) == 0:
        return {}
    q = np.percentile(samples_us, _QUANTILES)
    out = {f"p{p}": float(v) for p, v in zip(_QUANTILES, q)}
    out["max"] = float(np.max(samples_us))
    return out


def _item_and_batch_us(rep: Rep, group: int) -> tuple[Any, Any]:
    """Per-item and per-batch latencies (µs) of one repetition.

    Per item: one-item reads as timed; batch reads as the batch time divided by its
    size, once per item (the consumer's amortized cost of an item). Per batch: batch
    reads as timed; one-item reads as the sum of ``group`` consecutive items.
    """
    import numpy as np

    if rep.item_s is not None:
        item = np.asarray(rep.item_s) * 1e6
        whole = len(item) // group * group
        batch = item[:whole].reshape(-1, group).sum(axis=1) if whole else item.sum(keepdims=True)
        return item, batch
    batch = np.asarray(rep.batch_s) * 1e6
    sizes = np.asarray(rep.batch_sizes)
    return np.repeat(batch / sizes, sizes), batch


def measure(
    cases: Sequence[Case], reps: int, warmup: int, bar: Progress | None = None
) -> dict[str, dict[str, Any]]:
    """Warm up, then time ``cases`` round-robin ``reps`` times; a summary per case.

    Percentiles are taken per repetition and the median over repetitions is reported,
    like the wall time; ``item_cdf_us`` (101 quantiles, 0..100 %) pools every timed
    repetition, for plots.
    """
    import numpy as np

    if bar is not None:
        bar.rep(0, reps)
    for case in cases:
        for _ in range(warmup):
            _check(case, case.fn())
            if bar is not None:
                bar.update()
    walls: dict[str, list[float]] = {c.name: [] for c in cases}
    cpus: dict[str, list[float]] = {c.name: [] for c in cases}
    item_p: dict[str, list[dict[str, float]]] = {c.name: [] for c in cases}
    batch_p: dict[str, list[dict[str, float]]] = {c.name: [] for c in cases}
    pooled: dict[str, list[Any]] = {c.name: [] for c in cases}
    for rep_no in range(1, reps + 1):
        if bar is not None:
            bar.rep(rep_no, reps)
        for case in cases:
            gc.collect()
            cpu = time.process_time()
            started = time.perf_counter()
            rep = case.fn()
            walls[case.name].append(time.perf_counter() - started)
            cpus[case.name].append(time.process_time() - cpu)
            _check(case, rep)
            item, batch = _item_and_batch_us(rep, case.batch)
            item_p[case.name].append(_percentiles(item))
            batch_p[case.name].append(_percentiles(batch))
            pooled[case.name].append(item)
            if bar is not None:
                bar.update()
    out = {}
    for case in cases:
        median_s = statistics.median(walls[case.name])
        all_items = np.concatenate(pooled[case.name])
        out[case.name] = {
            "name": case.name,
            "role": case.role,
            "items": case.items,
            "item_bytes": case.item_bytes,
            "batch": case.batch,
            **case.params,
            "reps": reps,
            "median_s": median_s,
            "times_s": walls[case.name],
            "items_per_s": case.items / median_s,
            "mb_per_s": case.items * case.item_bytes / median_s / 1e6,
            "cpu_us_per_item": statistics.median(cpus[case.name]) / case.items * 1e6,
            "item_us": _median_of(item_p[case.name]),
            "batch_us": _median_of(batch_p[case.name]),
            "item_cdf_us": [float(v) for v in np.percentile(all_items, range(101))],
        }
    return out


def _median_of(per_rep: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(p[k] for p in per_rep) for k in per_rep[0]} if per_rep else {}


def _check(case: Case, rep: Rep) -> None:
    fail_if_incomplete(case.name, rep.items, case.items)


def ratios(
    cases: Mapping[str, Mapping[str, Any]], metric: str = "items_per_s"
) -> dict[str, dict[str, float]]:
    """``{asynccache case: {peer case: a/b}}`` for one comparison (same run).

    Cases whose consumer does work between items (``work``) are left out: their
    items/s measure the work too.
    """
    ours = [n for n, c in cases.items() if c["role"] == "asynccache" and not c.get("work")]
    peers = [n for n, c in cases.items() if c["role"] != "asynccache"]
    return {a: {p: cases[a][metric] / cases[p][metric] for p in peers} for a in ours}


# ---------------------------------------------------------------------- progress, output


def progress_bar(total: int, desc: str, enabled: bool) -> Progress:
    """A module's progress on stderr: its stage, runs done, the repetition under way (a
    bar on a terminal; one line per stage in a log)."""
    return Progress(total, desc, unit="run", enabled=enabled, log_stages=True)


def fmt_rate(x: float | None) -> str:
    """items/s or MB/s: 3 significant figures with k/M suffixes."""
    if x is None or not math.isfinite(x):
        return "-"
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def fmt_us(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if x >= 10_000:
        return f"{x / 1000:,.1f} ms"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def fmt_ratio(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.2f}×" if x < 10 else f"{x:.0f}×"


def fmt_size(n: int) -> str:
    for div, unit in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def case_cells(
    c: Mapping[str, Any], item: Sequence[str] = ("p50", "p95", "p99"),
    batch: Sequence[str] = ("p50", "p99"),
) -> list[str]:
    """A measured case as table cells: items/s, MB/s, item and batch percentiles, CPU."""
    return [
        fmt_rate(c["items_per_s"]),
        fmt_rate(c["mb_per_s"]),
        *(fmt_us(c["item_us"][p]) for p in item),
        *(fmt_us(c["batch_us"][p]) for p in batch),
        fmt_us(c["cpu_us_per_item"]),
    ]


def ratio_cells(block: Mapping[str, Any], name: str, roles: Sequence[str]) -> list[str]:
    """Case ``name``'s ratio to the peer playing each role in ``block`` ("" if none)."""
    ratios = block["ratios"].get(name, {})
    by_role = {c["role"]: other for other, c in block["cases"].items()}
    return [fmt_ratio(ratios.get(by_role.get(role, ""))) if ratios else "" for role in roles]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the others right."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":" if i else ":" + "-" * (w + 1)) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Move what exists now out of the collector's sight for the timed part.

    A full ``gc.collect()`` walks every object of the process (torch alone brings
    ~200k, ~90 ms); the per-repetition collection should only clean up after the
    benchmark itself.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def bench_redis_sync(store: Store) -> redis.Redis:
    return redis.Redis.from_url(store.url)


def bench_redis_async(store: Store) -> aioredis.Redis:
    """The floor's client: redis.asyncio with its default pool (hiredis parser if present)."""
    return aioredis.Redis.from_url(store.url)
