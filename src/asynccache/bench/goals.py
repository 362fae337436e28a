"""The performance goals of large values and scale-out, each one a ratio measured in one run.

Every goal compares asynccache with the peer that a user would otherwise pick, on the
same server, the same values and in the same run (timed round-robin, median of the
repetitions); the README states the goals and the bars, this module only measures:

* **wire** -- the loopback limit: one TCP stream from a child process, read with
  ``recv_into`` into one reused buffer (the most a client can get out of the link);
* **large** -- 256 KiB, 1 MiB and 4 MiB values on Redis, as ``bytes`` and as float32
  numpy arrays: ``dp[i]`` (prefetch=64) against redis-py ``GET`` per key (hiredis,
  ``pickle.loads``): MB/s, the share of the wire, and p99 per item at the consumer;
* **small** -- 100 B and 4 KiB values on Redis: ``dp[i]`` (prefetch=64) against the
  hand-written ``redis.asyncio`` MGET loop (batches of 64, 4 in flight, uvloop);
* **memcached** -- 100 B and 4 KiB: ``get_many`` and ``dp[i]`` against ``aiomcache``
  ``multi_get`` and ``emcache`` ``get_many`` (the same batches and requests in flight);
* **cluster** -- 100 B: ``get_many`` and ``dp[i]`` on a 3-node Redis Cluster against the
  same on one redis-server, directly and with 0.2 ms of round trip added by a loopback
  proxy in a child process (each node behind its own proxy, announced to clients);
* **cold** -- (also with items of ~1 ms of numpy work, where a cache's own costs show)
  a DataLoader epoch (2 workers, shuffled, batches of 32, items of 192 KiB
  that cost ~1.5 ms of CPU each) through ``async_kv_cache`` with an empty store, with
  ``set_order(loader.batch_sampler)`` and without it (the default use), and again warm,
  against the same epoch reading the source without a cache;
* **loader** -- warm epochs of the README's loop (2 workers, shuffled, 4 KiB, 100 KiB and
  1 MiB float32 arrays) through ``async_kv_cache`` on Redis and LMDB, against the same loader
  over a dataset that costs nothing and over a ``diskcache.Cache`` wrapper
  (`asynccache.bench.loader`);
* **copies** -- bytes copied (``memcpy``/``memmove``, counted by a preloaded shim) per
  byte of 100 KiB and 1 MiB values, ``bytes`` and float32 arrays, on Redis and memcached:
  the pipe's cold writes and warm ``dp[i]``, ``set_many`` and ``get_many``
  (`asynccache.bench.copies`);
* **ranks** -- a ``torch.distributed`` job (`asynccache.bench.ranks`): the share of warm
  reads that read-ahead served, with ``set_order`` following ``DistributedSampler``;
* **tiered** -- a warm DataLoader epoch through ``ac.Tiered(lmdb, redis)`` against the
  far store alone behind the latency proxy (`asynccache.bench.tiered`).

``summary`` lists one row per goal: what is compared, the two figures, the ratio.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asynccache as ac

from ..cli.progress import Progress
from ..testing import servers
from . import copies, loader, plots, ranks, tiered, workers
from ._common import (
    BenchError,
    Case,
    Session,
    Store,
    UvloopRunner,
    batches_of,
    fmt_rate,
    fmt_size,
    markdown_table,
    measure,
    progress_bar,
    quiet_gc,
    session_for,
    time_async_batches,
)
from .latency import Ours, Workload, readers
from .network import ProxyProcess, ping_us
from .peers import delete_keys

KIB, MIB = 1024, 1 << 20
LARGE_SIZES = (256 * KIB, MIB, 4 * MIB)
#: what the large values are: ``bytes``, and float32 numpy ``array``s of the same bytes
#: (pickled out of band: what a sample is, and what is decoded without a copy)
LARGE_KINDS = ("bytes", "array")
#: bytes read per repetition of a large-value case: (full, quick, smoke)
LARGE_BYTES = (512 * MIB, 256 * MIB, 8 * MIB)
SMALL_SIZES = (100, 4 * KIB)
SMALL_ITEMS = (20_000, 6_000, 400)
CLUSTER_ITEMS = (20_000, 6_000, 400)
CLUSTER_RTT = 0.2e-3
WIRE_BYTES = (512 * MIB, 256 * MIB, 16 * MIB)
WIRE_BUFFER = 4 * MIB
BATCH, IN_FLIGHT, PREFETCH = 64, 4, 64
# the cold-epoch DataLoader
COLD_ITEMS = (1_024, 512, 64)
#: items of the samplers' warm epochs (full, quick, smoke)
SAMPLER_ITEMS = (4_000, 2_048, 256)
COLD_WORKERS, COLD_BATCH = 2, 32
COLD_REPS = (3, 2, 1)

ITEM = "asynccache dp[i]"
GET_MANY = "asynccache get_many"


# ----------------------------------------------------------------------------- the wire


_SENDER = r"""
import socket, sys
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
chunk = memoryview(bytes(4 << 20))
while True:
    head = conn.recv(8, socket.MSG_WAITALL)
    if len(head) < 8:
        break
    left = int.from_bytes(head, "big")
    while left:
        n = conn.send(chunk[: min(left, len(chunk))])
        left -= n
"""


def wire_mb_per_s(total: int, reps: int) -> dict[str, Any]:
    """MB/s of one loopback TCP stream: a child process sends ``total`` bytes per request,
    this process reads them with ``recv_into`` into one reused buffer."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as sock:
            buf = memoryview(bytearray(WIRE_BUFFER))
            times = []
            for _ in range(reps + 1):  # the first warms the connection up
                started = time.perf_counter()
                sock.sendall(total.to_bytes(8, "big"))
                left = total
                while left:
                    n = sock.recv_into(buf, min(left, WIRE_BUFFER))
                    if not n:
                        raise BenchError("the loopback sender closed the stream early")
                    left -= n
                times.append(time.perf_counter() - started)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    times = times[1:]
    return {
        "bytes": total,
        "buffer": WIRE_BUFFER,
        "times_s": times,
        "mb_per_s": total / min(times) / 1e6,
        "median_mb_per_s": total / statistics.median(times) / 1e6,
    }


# ------------------------------------------------------------------------------- run


def run(
    *, quick: bool, out_dir: Path, progress: bool, session: Session | None = None
) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc():
        mode = s.mode_index
        redis_store = s.redis_store()
        if redis_store is None:
            raise BenchError("the goals need a Redis-protocol store (redis or valkey)")
        results: dict[str, Any] = {
            "config": {
                "large_sizes": list(LARGE_SIZES),
                "large_kinds": list(LARGE_KINDS),
                "large_bytes": LARGE_BYTES[mode],
                "small_sizes": list(SMALL_SIZES),
                "small_items": SMALL_ITEMS[mode],
                "cluster_items": CLUSTER_ITEMS[mode],
                "cluster_rtt_s": CLUSTER_RTT,
                "cold_items": COLD_ITEMS[mode],
                "cold_workers": COLD_WORKERS,
                "cold_batch": COLD_BATCH,
                "batch": BATCH,
                "in_flight": IN_FLIGHT,
                "prefetch": PREFETCH,
                "reps": s.reps,
                "mode": s.mode,
                "store": redis_store.label,
            },
        }
        runner = UvloopRunner()
        bar = progress_bar(0, "goals", s.progress)
        try:
            bar.describe("goals: loopback limit")
            results["wire"] = wire_mb_per_s(WIRE_BYTES[mode], s.reps)
            results["large"] = [
                _large(s, redis_store, size, mode, runner, bar, kind)
                for kind in LARGE_KINDS for size in LARGE_SIZES
            ]
            results["small"] = [
                _small(s, redis_store, size, mode, runner, bar) for size in SMALL_SIZES
            ]
            memcached = s.stores.get("memcached")
            results["memcached"] = (
                [_memcached(s, memcached, size, mode, runner, bar) for size in SMALL_SIZES]
                if memcached is not None
                else []
            )
            results["cluster"] = _cluster(s, redis_store, mode, runner, bar)
            bar.describe("goals: cold epochs")
            results["cold"] = _cold(s, redis_store, mode, runner)
            results["cold_cheap"] = _cold(s, redis_store, mode, runner, cheap=True)
            bar.describe("goals: warm epochs in the README's loop")
            results["loader"] = loader.run(s, redis_store)
            bar.describe("goals: bytes copied per byte")
            results["copies"] = copies.run(s, redis_store, memcached)
            bar.describe("goals: samplers followed")
            results["samplers"] = _samplers(s, redis_store, mode)
            bar.describe("goals: ranks of a distributed job")
            results["ranks"] = ranks.run(quick=quick, out_dir=out_dir, progress=False,
                                         session=s)
            bar.describe("goals: near/far tier")
            results["tiered"] = tiered.run(quick=quick, out_dir=out_dir, progress=False,
                                           session=s)
        finally:
            bar.close()
            runner.close()
        results["summary"] = summary_rows(results)
    return results


def _samplers(s: Session, store: Store, mode: int) -> dict[str, Any]:
    """Read-ahead in the loop users write, per sampler kind (`workers.sampler_cases`)."""
    import warnings

    import asynccache as ac

    n = SAMPLER_ITEMS[mode]
    namespace = s.namespace("samplers", store.name)
    with ac.AsyncKVCacheMapDataPipe(workers._Items(n), ac.connect(store.url),
                                    namespace=namespace, ttl=s.ttl(store)) as fill:
        fill.__getitems__(list(range(n)))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create")
        return {"items": n, "cases": workers.sampler_cases(store.url, namespace, n)}


def _timed(cases: Sequence[Case], s: Session, bar: Progress) -> dict[str, dict[str, Any]]:
    bar.add_total(len(cases) * (s.reps + s.warmup))
    return measure(cases, s.reps, s.warmup, bar)


def _large(
    s: Session, store: Store, size: int, mode: int, runner: UvloopRunner, bar: Progress,
    kind: str = "bytes",
) -> dict[str, Any]:
    bar.describe(f"goals: {fmt_size(size)} {kind} values")
    n = max(8, LARGE_BYTES[mode] // size)
    with Workload(s, store, size, n, "goal-large", runner, kind) as w, \
            readers(store, w, runner) as (ours, peers):
        cases = [ours.item(n, PREFETCH, BATCH), peers.naive(w.plain_keys, n, size, BATCH)]
        return {"value_bytes": size, "kind": kind, "items": n, "cases": _timed(cases, s, bar)}


def _small(
    s: Session, store: Store, size: int, mode: int, runner: UvloopRunner, bar: Progress
) -> dict[str, Any]:
    bar.describe(f"goals: {fmt_size(size)} values")
    n = SMALL_ITEMS[mode]
    with Workload(s, store, size, n, "goal-small", runner) as w, readers(store, w, runner) as (
        ours,
        peers,
    ):
        cases = [
            ours.item(n, PREFETCH, BATCH),
            ours.get_many(n, BATCH, IN_FLIGHT),
            peers.floor(w.plain_keys, n, size, BATCH),
        ]
        return {"value_bytes": size, "items": n, "cases": _timed(cases, s, bar)}


def _memcached(
    s: Session, store: Store, size: int, mode: int, runner: UvloopRunner, bar: Progress
) -> dict[str, Any]:
    bar.describe(f"goals: memcached {fmt_size(size)}")
    n = SMALL_ITEMS[mode]
    with Workload(s, store, size, n, "goal-mc", runner) as w, readers(store, w, runner) as (
        ours,
        peers,
    ):
        em = Emcache(store, runner)
        try:
            cases = [
                ours.item(n, PREFETCH, BATCH),
                ours.get_many(n, BATCH, IN_FLIGHT),
                peers.floor(w.plain_keys, n, size, BATCH),
                em.case(w.plain_keys, n, size),
            ]
            return {"value_bytes": size, "items": n, "cases": _timed(cases, s, bar)}
        finally:
            em.close()


class Emcache:
    """emcache ``get_many`` of batches, ``IN_FLIGHT`` outstanding, ``pickle.loads`` each:
    the fastest memcached client measured here (autobatching off: batches are given)."""

    def __init__(self, store: Store, runner: UvloopRunner) -> None:
        self.store = store
        self.runner = runner
        self.client: Any = None

    def case(self, keys: Sequence[str], n: int, item_bytes: int) -> Case:
        import pickle

        import emcache

        async def create() -> Any:
            return await emcache.create_client(
                [emcache.MemcachedHostAddress(self.store.host, self.store.port)],
                max_connections=IN_FLIGHT, min_connections=IN_FLIGHT, timeout=5.0,
            )

        if self.client is None:
            self.client = self.runner.run(create())
        client = self.client
        batches = batches_of([k.encode() for k in keys[:n]], BATCH)
        loads = pickle.loads

        async def one(batch: Sequence[bytes]) -> int:
            found = await client.get_many(batch)
            return len({k: loads(item.value) for k, item in found.items()})

        return Case(
            "emcache get_many", "floor", n, item_bytes, BATCH,
            lambda: self.runner.run(time_async_batches(one, batches, IN_FLIGHT)),
            {"in_flight": IN_FLIGHT},
        )

    def close(self) -> None:
        if self.client is not None:
            self.runner.run(self.client.close())
            self.client = None


# ---------------------------------------------------------------------------- cluster


def _cluster(
    s: Session, store: Store, mode: int, runner: UvloopRunner, bar: Progress
) -> list[dict[str, Any]]:
    """100 B values on one node and on a 3-node cluster, direct and through proxies."""
    n = CLUSTER_ITEMS[mode]
    out = []
    bar.describe("goals: cluster, direct")
    cluster = servers.start_redis_cluster(3, binary=servers.find_redis_binary("redis")[0])
    try:
        out.append(_cluster_level(s, store, _cluster_store(store, cluster.url), n, 0.0,
                                  runner, bar))
    finally:
        cluster.stop()
    bar.describe(f"goals: cluster, +{CLUSTER_RTT * 1e3:g} ms")
    with ProxyProcess() as proxies:
        one_port = proxies.proxy_for(store)
        for attempt in range(3):  # a node's free port may be taken before it binds it
            nodes = [servers.RedisServer(servers.find_redis_binary("redis")[0], cluster=True)
                     for _ in range(3)]
            ports = []
            for node in nodes:
                assert node.port is not None
                ports.append(proxies.proxy_to(node.host, node.port))
                node.announce_port = ports[-1]
            targets = [node.port for node in nodes]
            cluster = servers.RedisCluster(nodes)
            cluster.start()
            if [node.port for node in cluster.nodes] == targets:
                break
            cluster.stop()
            if attempt == 2:
                raise BenchError("a cluster node lost its port to another process 3 times: "
                                 "run again")
        try:
            for port in [one_port, *ports]:
                proxies.set_latency(port, CLUSTER_RTT)
            hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
            proxied_one = store.at("127.0.0.1", one_port)
            level = _cluster_level(s, proxied_one, _cluster_store(store, f"redis+cluster://{hosts}"),
                                   n, CLUSTER_RTT, runner, bar)
            level["ping_us"] = ping_us(proxied_one)
            out.append(level)
        finally:
            cluster.stop()
    return out


def _cluster_store(like: Store, url: str) -> Store:
    return dataclasses.replace(like, name="cluster", url=url, private=True, password=None,
                               username=None)


def _cluster_level(
    s: Session, one: Store, cluster: Store, n: int, rtt: float, runner: UvloopRunner, bar: Progress
) -> dict[str, Any]:
    values = [os.urandom(100) for _ in range(n)]
    namespace = s.namespace("goal-cluster", int(rtt * 1e6))
    cases = []
    readers = []
    try:
        for label, store in (("one node", one), ("3-node cluster", cluster)):
            ours = Ours(store, runner, namespace, values, None)
            readers.append(ours)

            async def write(cache: ac.AsyncKVCache = ours.cache) -> None:
                for chunk in batches_of(list(enumerate(values)), 1000):
                    await cache.set_many(dict(chunk))

            runner.run(write())
            cases += [
                ours.get_many(n, BATCH, IN_FLIGHT, name=f"{label} get_many"),
                ours.item(n, PREFETCH, BATCH, name=f"{label} dp[i]"),
            ]
        measured = _timed(cases, s, bar)
    finally:
        for ours in readers:
            ours.close()
    return {"rtt_added_s": rtt, "items": n, "value_bytes": 100, "cases": measured}


# ------------------------------------------------------------------------- cold epochs


class ColdSource:
    """``n`` items that cost real CPU: a 3x256x256 image resized to a 3x128x128 float32
    tensor (192 KiB), ~1.5 ms each with one torch thread."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        import torch

        if not 0 <= index < self.n:
            raise IndexError(index)
        g = torch.Generator().manual_seed(index)
        raw = torch.randint(0, 256, (1, 3, 256, 256), generator=g, dtype=torch.uint8)
        return torch.nn.functional.interpolate(
            raw.float(), size=(128, 128), mode="bicubic", antialias=True, align_corners=False
        )[0]


class CheapSource(ColdSource):
    """``n`` items that cost little CPU, the case where a cache's own costs show: a
    3x256x256 uint8 image pooled to a normalised 3x128x128 float32 array (192 KiB) with
    numpy, ~1 ms each (measured in the run: ``item_ms``)."""

    def __getitem__(self, index: int) -> Any:
        import numpy as np

        if not 0 <= index < self.n:
            raise IndexError(index)
        raw = np.random.default_rng(index).integers(0, 256, (3, 256, 256), dtype=np.uint8)
        x = raw.astype(np.float32)
        x = (x[:, 0::2, 0::2] + x[:, 1::2, 0::2] + x[:, 0::2, 1::2] + x[:, 1::2, 1::2]) * 0.25
        x = (x - x.mean(axis=(1, 2), keepdims=True)) / (x.std(axis=(1, 2), keepdims=True) + 1)
        return np.ascontiguousarray(x, dtype=np.float32)


def _item_ms(source: Any, n: int = 64) -> float:
    """What one item of ``source`` costs here, in ms (in this process, one thread)."""
    started = time.perf_counter()
    for i in range(min(n, len(source))):
        source[i]
    return (time.perf_counter() - started) * 1e3 / min(n, len(source))


def _one_thread(_: int) -> None:
    import torch

    torch.set_num_threads(1)


def _epoch(dataset: Any, follow: bool = True) -> tuple[float, float]:
    """One shuffled epoch with fresh workers: (seconds, checksum of every value); a pipe
    is told the loader's order when ``follow``."""
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset, batch_size=COLD_BATCH, shuffle=True, num_workers=COLD_WORKERS,
        worker_init_fn=_one_thread,
    )
    if follow and isinstance(dataset, ac.AsyncKVCacheMapDataPipe):
        assert loader.batch_sampler is not None
        dataset.set_order(loader.batch_sampler)
    total = 0.0
    started = time.perf_counter()
    for batch in loader:
        total += float(torch.sum(batch, dtype=torch.float64))
    return time.perf_counter() - started, total


def _cold(s: Session, store: Store, mode: int, runner: UvloopRunner,
          cheap: bool = False) -> dict[str, Any]:
    """Epochs without a cache, then cold and warm through the pipe (and, for the costly
    items, cold without set_order), on fresh workers each."""
    n = COLD_ITEMS[mode]
    source: Any = CheapSource(n) if cheap else ColdSource(n)
    tag = "goal-cold-cheap" if cheap else "goal-cold"
    client = ac.connect(store.url)
    times: dict[str, list[float]] = {"no cache": [], "cold": [], "warm": []}
    if not cheap:
        times["cold, no set_order"] = []
    sums: set[float] = set()
    computed = []
    try:
        _epoch(source)  # warm-up: page in torch and the workers' imports
        for rep in range(COLD_REPS[mode]):
            t, total = _epoch(source)
            times["no cache"].append(t)
            sums.add(round(total, 3))
            pipe = ac.AsyncKVCacheMapDataPipe(
                source, client, prefetch=PREFETCH, namespace=s.namespace(tag, rep)
            )
            try:
                for phase in ("cold", "warm"):
                    t, total = _epoch(pipe)
                    times[phase].append(t)
                    sums.add(round(total, 3))
                computed.append(pipe.stats().get("computed", 0))
            finally:
                pipe.close()
                delete_keys(store, [pipe.key_for(i) for i in range(n)])
            if cheap:
                continue
            blind = ac.AsyncKVCacheMapDataPipe(
                source, client, prefetch=PREFETCH, namespace=s.namespace("goal-cold-blind", rep)
            )
            try:
                t, total = _epoch(blind, follow=False)
                times["cold, no set_order"].append(t)
                sums.add(round(total, 3))
            finally:
                blind.close()
                delete_keys(store, [blind.key_for(i) for i in range(n)])
    finally:
        runner.run(client.close())
    if len(sums) != 1:
        raise BenchError(f"the epochs read different values: checksums {sorted(sums)}")
    return {
        "items": n,
        "item_bytes": 3 * 128 * 128 * 4,
        "item_ms": _item_ms(source),
        "workers": COLD_WORKERS,
        "times_s": times,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "computed_per_rep": computed,
    }


# --------------------------------------------------------------------------- summary


def _case(block: dict[str, Any], name: str) -> dict[str, Any]:
    return block["cases"][name]


def _row(goal: str, ours: str, a: float, peer: str, b: float, ratio: float,
         unit: str) -> dict[str, Any]:
    return {"goal": goal, "ours": ours, "ours_value": a, "peer": peer, "peer_value": b,
            "ratio": ratio, "unit": unit}


def summary_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per goal: both figures and their ratio (higher is better, except p99 and
    epoch times, where the ratio is ours over the peer's and lower is better)."""
    rows = []
    wire = results["wire"]["mb_per_s"]
    for block in results["large"]:
        size = fmt_size(block["value_bytes"])
        if block.get("kind", "bytes") != "bytes":
            size = f"{size} {block['kind']}"
        ours, naive = _case(block, ITEM), _case(block, "redis-py GET per key")
        rows.append(_row(f"{size} dp[i] MB/s vs per-key GET", "dp[i]", ours["mb_per_s"],
                         "redis-py GET", naive["mb_per_s"],
                         ours["mb_per_s"] / naive["mb_per_s"], "MB/s"))
        rows.append(_row(f"{size} dp[i] share of the loopback limit", "dp[i]",
                         ours["mb_per_s"], "one TCP stream", wire, ours["mb_per_s"] / wire,
                         "MB/s"))
        a, b = ours["item_us"]["p99"], naive["item_us"]["p99"]
        rows.append(_row(f"{size} dp[i] p99 per item vs per-key GET (lower is better)",
                         "dp[i]", a, "redis-py GET", b, a / b, "µs"))
    for block in results["small"]:
        size = fmt_size(block["value_bytes"])
        ours, floor = _case(block, ITEM), _case(block, "redis.asyncio MGET loop")
        rows.append(_row(f"{size} dp[i] vs hand-written MGET loop", "dp[i]",
                         ours["items_per_s"], "redis.asyncio MGET", floor["items_per_s"],
                         ours["items_per_s"] / floor["items_per_s"], "items/s"))
    for block in results["memcached"]:
        size = fmt_size(block["value_bytes"])
        for name, label in ((GET_MANY, "get_many"), (ITEM, "dp[i]")):
            for peer in ("emcache get_many", "aiomcache multi_get"):
                a, b = _case(block, name)["items_per_s"], _case(block, peer)["items_per_s"]
                rows.append(_row(f"memcached {size} {label} vs {peer.split()[0]}", label, a,
                                 peer, b, a / b, "items/s"))
    for level in results["cluster"]:
        rtt = f"+{level['rtt_added_s'] * 1e3:g} ms"
        for label in ("get_many", "dp[i]"):
            a = _case(level, f"3-node cluster {label}")["items_per_s"]
            b = _case(level, f"one node {label}")["items_per_s"]
            rows.append(_row(f"3-node cluster {label} vs one node, {rtt}", "cluster", a,
                             "one node", b, a / b, "items/s"))
    if "cold_cheap" in results:  # absent in results of an older run
        cheap = results["cold_cheap"]
        for phase in ("cold", "warm"):
            a, b = cheap["median_s"][phase], cheap["median_s"]["no cache"]
            rows.append(_row(f"{phase} DataLoader epoch, ~{cheap['item_ms']:.1f} ms numpy "
                             "items, vs no cache (lower is better)", phase, a, "no cache", b,
                             a / b, "s"))
    for block in results.get("loader", {}).get("by_size", []):  # absent: an older run
        size, cases = fmt_size(block["value_bytes"]), block["cases"]
        for case in (loader.REDIS, loader.LMDB):
            rows.append(_row(f"warm DataLoader epoch, {size}, {case} vs the loader's own "
                             "limit", case, cases[case]["items_per_s"], loader.LIMIT,
                             cases[loader.LIMIT]["items_per_s"],
                             block["ratio_vs_limit"][case], "items/s"))
        rows.append(_row(f"warm DataLoader epoch, {size}, {loader.REDIS} vs diskcache",
                         loader.REDIS, cases[loader.REDIS]["items_per_s"], loader.DISKCACHE,
                         cases[loader.DISKCACHE]["items_per_s"],
                         block["ratio_vs_diskcache"][loader.REDIS], "items/s"))
        if "rss_vs_limit" in block:  # absent in results of an older run
            rows.append(_row(f"warm DataLoader epoch, {size}, {loader.REDIS}: peak RSS per "
                             "worker vs the loader's limit (lower is better)", loader.REDIS,
                             cases[loader.REDIS]["worker_peak_rss_mib"], loader.LIMIT,
                             cases[loader.LIMIT]["worker_peak_rss_mib"],
                             block["rss_vs_limit"][loader.REDIS], "MiB"))
    for block in results.get("copies", {}).get("results", []):  # absent: older or no cc
        if block["value_bytes"] != copies.ROW_SIZE:
            continue
        size = f"{fmt_size(block['value_bytes'])} {block['kind']}"
        for phase, per_byte in block["per_byte"].items():
            rows.append(_row(f"{size}, {block['store']} {phase}: bytes copied per byte "
                             "(lower is better)", phase, per_byte, "the kernel's own copy",
                             1.0, per_byte, "bytes/byte"))
    cold = results["cold"]["median_s"]
    for phase in ("cold", "cold, no set_order", "warm"):
        if phase not in cold:  # results of an older run
            continue
        rows.append(_row(f"{phase} DataLoader epoch vs no cache (lower is better)", phase,
                         cold[phase], "no cache", cold["no cache"],
                         cold[phase] / cold["no cache"], "s"))
    for name, case in results.get("samplers", {}).get("cases", {}).items():
        if "not followable" not in name:  # (the waste of each case: `table()`)
            rows.append(_row(f"{name}: warm reads served by read-ahead", "set_order",
                             case["served"], "every warm read", 1.0, case["served"], "share"))
    job = results.get("ranks", {}).get("cases", {})  # absent in results of an older run
    if "set_order" in job:
        share = job["set_order"]["served_by_read_ahead"]
        rows.append(_row("2 ranks x 2 workers: warm reads served by read-ahead", "set_order",
                         share, "every warm read", 1.0, share, "share"))
    for level in results.get("tiered", {}).get("levels", []):
        cases = level["cases"]
        a = cases["tiered, warm from near"]["epoch_s"]
        b = cases["far alone"]["epoch_s"]
        rows.append(_row(f"tiered warm epoch vs far alone, +{level['rtt_added_s'] * 1e3:g} ms "
                         "(lower is better)", "tiered", a, "far alone", b, a / b, "s"))
    return rows


def _fmt(value: float, unit: str) -> str:
    if unit == "µs":
        return f"{value / 1e3:,.1f} ms" if value >= 10_000 else f"{value:,.0f} µs"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "share":
        return f"{value:.0%}"
    if unit == "MB/s":
        return f"{value:,.0f} MB/s"
    if unit == "MiB":
        return f"{value:,.0f} MiB"
    return f"{fmt_rate(value)}/s"


def table(results: dict[str, Any]) -> str:
    rows = [
        [r["goal"], _fmt(r["ours_value"], r["unit"]), r["peer"], _fmt(r["peer_value"], r["unit"]),
         f"{r['ratio']:.2f}"]
        for r in results["summary"]
    ]
    wire = results["wire"]
    head = (
        f"### The goals of large values and scale-out, one run "
        f"({results['config']['store']}, {results['config']['reps']} repetitions, median)\n\n"
        f"Loopback limit: {wire['mb_per_s']:,.0f} MB/s (one TCP stream, recv_into a "
        f"{fmt_size(wire['buffer'])} buffer, best of {len(wire['times_s'])}; median "
        f"{wire['median_mb_per_s']:,.0f}).\n\n"
    )
    samplers = results.get("samplers")
    tail = ""
    if samplers:
        tail = (f"\n\nRead-ahead in the README's loop (`set_order(loader.batch_sampler)`, no "
                f"generator given), 2 workers, {samplers['items']:,} items, warm epochs "
                "(goals: served >= 95%, keys read ahead in vain <= 2% of reads):\n\n"
                + markdown_table(
                    ["sampler, workers", "served by read-ahead", "read ahead in vain",
                     "stops"],
                    [[name, f"{c['served']:.1%}", f"{c['wasted']:.1%}", c["stopped"]]
                     for name, c in samplers["cases"].items()]))
    return head + markdown_table(["goal", "asynccache", "peer", "peer's", "ratio"],
                                 rows) + tail


def _group(goal: str) -> str:
    if "peak RSS" in goal:
        return "memory"
    if goal.startswith(("cold", "warm")):
        return "epochs"
    if goal.startswith(("2 ranks", "tiered")):
        return "scale-out"
    if goal.startswith(tuple(workers.SAMPLERS)):
        return "read-ahead"
    if goal.startswith(("memcached", "3-node")):
        return goal.split(" ")[0].replace("3-node", "cluster")
    return "large values" if "MB/s" in goal or "loopback" in goal or "p99" in goal \
        else "small values"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    groups: dict[str, dict[str, float]] = {}
    for r in results["summary"]:
        groups.setdefault(_group(r["goal"]), {})[r["goal"]] = r["ratio"]
    return [
        plots.bars(
            out_dir / "goals_ratios.png",
            groups,
            title="asynccache ÷ its peer, one run (p99 and epochs: lower is better)",
            xlabel="ratio",
        )
    ]
