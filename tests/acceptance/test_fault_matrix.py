"""The fault matrix: every store × every fault × every way of reading, on real servers.

Stores: one Redis, one memcached, a pool of 3 memcached, a 3-node Redis Cluster — each
node behind its own loopback :class:`~asynccache.testing.proxy.FaultProxy`. Faults: the store
down at start, killed mid-scan and restarted on the same port, a black hole, connection
resets, a trickling link, idle connections closed by the server, a full store
(``noeviction``) and an evicting one (LRU), one node of a pool or cluster killed,
corrupt / truncated / swapped bytes. Ways of reading: ``dp[i]``, ``__getitems__``,
4 threads sharing the pipe, a DataLoader with 2 worker processes.

Every scenario checks what the README promises: no wrong value, no exception in
fallback mode, every read bounded by the timeout (plus the item's own compute), and the
cache used again once the fault is gone (``time to recover``). Raise mode gets the
specific ``CacheError`` subclass during the fault and no stale error after it.

Set ``ASYNCCACHE_MATRIX_OUT=path.jsonl`` to record one line of measurements per scenario.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from torch.utils.data import DataLoader

import asynccache as ac
from asynccache.testing import servers
from asynccache.testing.proxy import FaultProxy, url_through

TIMEOUT = 0.25  # every store operation, end to end
N = 240  # items per scan
VALUE_BYTES = 200
COMPUTE = 0.005  # seconds per computed item: a fault lasts long enough to see probes fail
#: What a read or a batch may take during a fault. The deadline bounds a read by one
#: timeout (a batch: its read plus its writes' acknowledgement), but these bounds are
#: sized by what they guard against, not by that: without a deadline a black hole never
#: answers and the trickle takes ~10 s per request. A bound far below that and far above
#: the timeout proves the deadline on a busy shared machine; the worst-case latencies
#: themselves are figures (ASYNCCACHE_MATRIX_OUT, asynccache bench), not asserts.
READ_BOUND = 10 * TIMEOUT
BATCH_BOUND = 16 * TIMEOUT
RECOVER_WITHIN = 40.0  # the longest back-off is 30 s


class Source:
    """index -> a value naming it, so a wrong value cannot pass for a right one."""

    def __init__(self, n: int = N, size: int = VALUE_BYTES, compute: float = COMPUTE) -> None:
        self.n = n
        self.size = size
        self.compute = compute

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        if self.compute:
            time.sleep(self.compute)
        return {"i": index, "pad": bytes([index % 251]) * self.size}


def right(value: Any, index: int, size: int = VALUE_BYTES) -> bool:
    return (isinstance(value, dict) and value.get("i") == index
            and value.get("pad") == bytes([index % 251]) * size)


# --------------------------------------------------------------------------- deployments


@dataclass
class Deployment:
    """Store nodes, each behind a proxy, and how to break and mend them."""

    backend: str
    nodes: list[Any]
    proxies: list[FaultProxy]
    url: str
    cluster: servers.RedisCluster | None = None
    owned: list[Any] = field(default_factory=list)

    def kill(self, i: int) -> None:
        if self.cluster is not None:
            self.cluster.kill(i)
        else:
            self.nodes[i].kill()

    def restart(self, i: int) -> None:
        if self.cluster is not None:
            self.cluster.restart(i)
        else:
            self.nodes[i].restart()

    def heal(self) -> None:
        for proxy in self.proxies:
            proxy.set_latency(0)
            proxy.set_blackhole(False)
            proxy.set_trickle(None)
            proxy.set_refuse(False)
        dead = [i for i, node in enumerate(self.nodes) if not node.is_running()]
        if self.cluster is not None and dead:
            for i in dead:  # all of them first: a cluster is ok only with every node back
                self.nodes[i].restart()
            self.cluster.wait_ok()
            return
        for i in dead:
            self.restart(i)

    def connect(self, **options: Any) -> ac.BaseClient:
        return ac.connect(self.url, timeout=TIMEOUT, connect_timeout=TIMEOUT, **options)

    def raw_set(self, entries: dict[bytes, bytes]) -> None:
        """Write bytes under store keys directly (as any other writer of the store could)."""
        async def put() -> None:
            client = ac.connect(self.url, timeout=5)
            try:
                await client.set_many(entries)
            finally:
                await client.close()

        asyncio.run(put())

    def raw_get(self, keys: list[bytes]) -> list[bytes | None]:
        async def get() -> list[bytes | None]:
            client = ac.connect(self.url, timeout=5)
            try:
                return await client.get_many(keys)
            finally:
                await client.close()

        return asyncio.run(get())

    def stop(self) -> None:
        for thing in reversed(self.owned):
            thing.stop()


def _proxied(node: Any) -> FaultProxy:
    return FaultProxy(node.host, node.port).start()


def deploy(backend: str, **server_options: Any) -> Deployment:
    if backend == "redis":
        node = servers.start_redis(prefer="redis", **server_options)
        proxy = _proxied(node)
        return Deployment(backend, [node], [proxy], url_through(proxy, node.url),
                          owned=[node, proxy])
    if backend in ("memcached", "memcached-pool"):
        count = 1 if backend == "memcached" else 3
        nodes = [servers.start_memcached(**server_options) for _ in range(count)]
        proxies = [_proxied(n) for n in nodes]
        url = "memcached://" + ",".join(f"127.0.0.1:{p.port}" for p in proxies)
        return Deployment(backend, nodes, proxies, url, owned=[*nodes, *proxies])
    if backend == "cluster":
        cluster = servers.start_redis_cluster(3, through_proxies=True)
        return Deployment(backend, cluster.nodes, cluster.proxies, cluster.url,
                          cluster=cluster, owned=[cluster])
    raise AssertionError(backend)


BACKENDS = ["redis", "memcached", "memcached-pool", "cluster"]
_deployments: dict[str, Deployment] = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_deployments() -> Iterator[None]:
    yield
    for deployment in _deployments.values():
        deployment.stop()
    _deployments.clear()


def deployment_for(backend: str) -> Deployment:
    if backend not in _deployments:
        _deployments[backend] = deploy(backend)
    deployment = _deployments[backend]
    deployment.heal()
    return deployment


# --------------------------------------------------------------------------- faults


class Fault:
    """A fault applied mid-scan (``start``, after a third of the reads) and lifted
    (``stop``, after two thirds). ``before`` runs before the scan starts."""

    name = ""
    multi_node_only = False

    def before(self, d: Deployment, pipe: ac.AsyncKVCacheMapDataPipe) -> None:
        return None

    def start(self, d: Deployment) -> None:
        return None

    def stop(self, d: Deployment) -> None:
        return None


class DownAtStart(Fault):
    name = "down at start"

    def before(self, d: Deployment, pipe: ac.AsyncKVCacheMapDataPipe) -> None:
        for i in range(len(d.nodes)):
            d.kill(i)

    def stop(self, d: Deployment) -> None:
        d.heal()


class KilledRestarted(Fault):
    name = "killed, restarted"

    def start(self, d: Deployment) -> None:
        for i in range(len(d.nodes)):
            d.kill(i)

    def stop(self, d: Deployment) -> None:
        d.heal()


class BlackHole(Fault):
    name = "black hole"

    def start(self, d: Deployment) -> None:
        for proxy in d.proxies:
            proxy.set_blackhole(True)

    def stop(self, d: Deployment) -> None:
        for proxy in d.proxies:
            proxy.set_blackhole(False)


class Reset(Fault):
    name = "reset"

    def start(self, d: Deployment) -> None:
        for proxy in d.proxies:
            proxy.set_latency(0.02)  # so that some requests are in flight when it hits
        for proxy in d.proxies:
            proxy.reset_all()

    def stop(self, d: Deployment) -> None:
        for proxy in d.proxies:
            proxy.set_latency(0)


class Trickle(Fault):
    name = "trickle"

    def start(self, d: Deployment) -> None:
        for proxy in d.proxies:
            proxy.set_trickle(64, 0.1)  # bytes keep coming, far too slowly

    def stop(self, d: Deployment) -> None:
        for proxy in d.proxies:
            proxy.set_trickle(None)


class OneNodeKilled(Fault):
    name = "one node killed"
    multi_node_only = True

    def start(self, d: Deployment) -> None:
        d.kill(1)

    def stop(self, d: Deployment) -> None:
        d.heal()


class Corrupt(Fault):
    """A third of the keys hold junk, a third truncated values, a third swapped ones."""

    name = "corrupt, truncated, swapped"

    def before(self, d: Deployment, pipe: ac.AsyncKVCacheMapDataPipe) -> None:
        keys = [pipe.key_for(i) for i in range(N)]
        good = d.raw_get(keys)
        bad: dict[bytes, bytes] = {}
        for i, (key, blob) in enumerate(zip(keys, good)):
            assert blob is not None
            if i % 3 == 0:
                bad[key] = b"\x00junk" * 10
            elif i % 3 == 1:
                bad[key] = blob[: len(blob) // 2]
            else:
                bad[key] = good[(i + 3) % N] or b""  # another item's valid value
        d.raw_set(bad)


FAULTS: list[Fault] = [DownAtStart(), KilledRestarted(), BlackHole(), Reset(), Trickle(),
                       OneNodeKilled(), Corrupt()]
MODES = ["dp[i]", "__getitems__", "4 threads", "DataLoader 2 workers"]


# --------------------------------------------------------------------------- scans


@dataclass
class Scan:
    wrong: int = 0
    exceptions: list[BaseException] = field(default_factory=list)
    worst_read: float = 0.0
    worst_batch: float = 0.0
    reads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, index: int, value: Any, seconds: float) -> None:
        with self.lock:
            self.reads += 1
            self.wrong += not right(value, index)
            self.worst_read = max(self.worst_read, seconds)


def scan(pipe: ac.AsyncKVCacheMapDataPipe, mode: str, hooks: dict[int, Callable[[], None]]
         ) -> Scan:
    """Read every index once in ``mode``; ``hooks[k]`` runs after the k-th read."""
    result = Scan()
    done = [0]
    fired: set[int] = set()
    hook_lock = threading.Lock()

    def progress(count: int) -> None:
        with hook_lock:
            done[0] += count
            due = [k for k in sorted(hooks) if k <= done[0] and k not in fired]
            fired.update(due)
            for k in due:
                hooks[k]()

    def one(index: int) -> None:
        started = time.perf_counter()
        try:
            value = pipe[index]
        except Exception as exc:
            result.exceptions.append(exc)
            return
        result.read(index, value, time.perf_counter() - started)
        progress(1)

    if mode == "dp[i]":
        for index in range(N):
            one(index)
    elif mode == "__getitems__":
        for start in range(0, N, 16):
            batch = list(range(start, min(N, start + 16)))
            started = time.perf_counter()
            try:
                values = pipe.__getitems__(batch)
            except Exception as exc:
                result.exceptions.append(exc)
                continue
            seconds = time.perf_counter() - started
            result.worst_batch = max(result.worst_batch, seconds)
            for index, value in zip(batch, values):
                result.read(index, value, 0.0)
            progress(len(batch))
    elif mode == "4 threads":
        quarters = [range(t, N, 4) for t in range(4)]  # interleaved: threads contend
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for future in [pool.submit(lambda q=q: [one(i) for i in q]) for q in quarters]:
                future.result()
    elif mode == "DataLoader 2 workers":
        loader = DataLoader(pipe, batch_size=16, num_workers=2, collate_fn=list,
                            multiprocessing_context="fork", timeout=60)
        index = 0
        started = time.perf_counter()
        try:
            for batch in loader:
                seconds = time.perf_counter() - started
                if index:  # the first batch also pays for starting the workers
                    result.worst_batch = max(result.worst_batch, seconds)
                for value in batch:
                    result.read(index, value, 0.0)
                    index += 1
                progress(len(batch))
                started = time.perf_counter()
        except Exception as exc:
            result.exceptions.append(exc)
    else:
        raise AssertionError(mode)
    return result


def warm(d: Deployment, namespace: str) -> None:
    """Every key in the store before the fault starts: on a loaded machine a write of the
    first pass may time out (fallback drops it), so the pass is repeated for what is
    missing (a few times at most)."""
    for _ in range(5):
        with ac.AsyncKVCacheMapDataPipe(Source(compute=0), d.connect(),
                                        namespace=namespace) as pipe:
            pipe.__getitems__(list(range(N)))
            keys = [pipe.key_for(i) for i in range(N)]
        if None not in d.raw_get(keys):
            return
    raise AssertionError("the store never held every value of the warm-up")


def recover(d: Deployment, namespace: str,
            pipe: ac.AsyncKVCacheMapDataPipe | None = None) -> float:
    """Seconds until scans are served from the store again (what the fault cost was
    written back meanwhile). With ``pipe``, the pipe that lived through the fault: its
    back-off decides when it asks the store again."""
    started = time.monotonic()
    own = pipe is None
    if pipe is None:
        pipe = ac.AsyncKVCacheMapDataPipe(Source(compute=0), d.connect(), namespace=namespace)
    try:
        while time.monotonic() - started < RECOVER_WITHIN:
            before = pipe.stats()["hits"]
            values = pipe.__getitems__(list(range(N)))
            assert all(right(v, i) for i, v in enumerate(values))
            if pipe.stats()["hits"] - before >= 0.95 * N:
                return time.monotonic() - started
            time.sleep(0.05)
    finally:
        if own:
            pipe.close()
    raise AssertionError(f"the cache was not used again within {RECOVER_WITHIN} s")


def record(row: dict[str, Any]) -> None:
    path = os.environ.get("ASYNCCACHE_MATRIX_OUT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


def cases() -> Iterator[Any]:
    for backend in BACKENDS:
        for fault in FAULTS:
            if fault.multi_node_only and backend not in ("memcached-pool", "cluster"):
                continue
            for mode in MODES:
                yield pytest.param(backend, fault, mode, id=f"{backend}-{fault.name}-{mode}")


@pytest.mark.parametrize(("backend", "fault", "mode"), list(cases()))
def test_fallback(backend: str, fault: Fault, mode: str, namespace: str) -> None:
    d = deployment_for(backend)
    warm(d, namespace)
    pipe = ac.AsyncKVCacheMapDataPipe(Source(), d.connect(), namespace=namespace, prefetch=32)
    try:
        fault.before(d, pipe)
        result = scan(pipe, mode, {N // 3: lambda: fault.start(d),
                                   2 * N // 3: lambda: fault.stop(d)})
        stats = pipe.stats()
        d.heal()
        recovered = recover(d, namespace, pipe)  # the same pipe: after its back-off
    finally:
        pipe.close(timeout=2)
        d.heal()
    record({"backend": backend, "fault": fault.name, "mode": mode, "wrong": result.wrong,
            "exceptions": len(result.exceptions), "worst_read_s": round(result.worst_read, 3),
            "worst_batch_s": round(result.worst_batch, 3), "recover_s": round(recovered, 2),
            "errors": stats["errors"], "hits": stats["hits"]})
    assert result.exceptions == []
    assert result.wrong == 0 and result.reads == N
    if isinstance(fault, OneNodeKilled) and mode != "DataLoader 2 workers":
        # the live nodes' keys are served throughout: every read before the fault, ~2/3
        # of those during and after it (~0.8 N). On a busy machine some of those time
        # out (a 0.25 s connect while the map is re-read); the bound is the fault's
        # scale: losing the whole cluster for the window (~0.45 N) must fail.
        assert stats["hits"] >= 0.6 * N, stats
    assert result.worst_read <= READ_BOUND, result.worst_read
    if mode == "DataLoader 2 workers":
        assert result.worst_batch <= BATCH_BOUND + 1.0, result.worst_batch
    else:
        assert result.worst_batch <= BATCH_BOUND, result.worst_batch


# --------------------------------------------------------------------------- raise mode

RAISED: dict[str, type[ac.CacheError]] = {
    "down at start": ac.StoreUnavailable, "killed, restarted": ac.StoreUnavailable,
    "black hole": ac.StoreTimeout, "trickle": ac.StoreTimeout,
    "one node killed": ac.StoreUnavailable, "corrupt, truncated, swapped": ac.DecodeError,
}


def raise_cases() -> list[Any]:
    return [pytest.param(backend, fault, id=f"{backend}-{fault.name}")
            for backend in BACKENDS for fault in FAULTS
            if fault.name in RAISED
            and not (fault.multi_node_only and backend not in ("memcached-pool", "cluster"))]


@pytest.mark.parametrize(("backend", "fault"), raise_cases())
def test_raise_mode(backend: str, fault: Fault, namespace: str) -> None:
    """The fault surfaces as its own CacheError subclass; once it is gone, nothing stale."""
    d = deployment_for(backend)
    warm(d, namespace)
    pipe = ac.AsyncKVCacheMapDataPipe(Source(), d.connect(), namespace=namespace,
                                      on_error="raise", prefetch=32)
    expected = RAISED[fault.name]
    raised: list[BaseException] = []
    try:
        fault.before(d, pipe)
        fault.start(d)
        for index in range(0, N, 8):  # a sample: without back-off each read waits
            try:
                assert right(pipe[index], index)
            except ac.CacheError as exc:
                raised.append(exc)
            if len(raised) >= 3:
                break
        fault.stop(d)
        d.heal()
        assert raised and all(isinstance(e, expected) for e in raised), raised
        if isinstance(fault, Corrupt):
            warm(d, namespace)  # the bad bytes are still there: put good ones back
        started = time.monotonic()
        while True:  # the store is back (a restarted node may take a moment)
            try:
                pipe[0]
                break
            except ac.StoreError:
                assert time.monotonic() - started < RECOVER_WITHIN
                time.sleep(0.05)
        for index in range(N):  # no stale error after recovery
            assert right(pipe[index], index)
    finally:
        pipe.close(timeout=2)
        d.heal()


# --------------------------------------------------------------------------- idle, full

IDLE_OPTIONS = {"redis": {"idle_timeout": 1},
                "memcached": {"extra_args": ["-o", "idle_timeout=1"]}}


@pytest.mark.parametrize("backend", ["redis", "memcached", "cluster"])
@pytest.mark.parametrize("mode", ["dp[i]", "__getitems__", "4 threads"])
def test_idle_connections_closed_by_the_server_cost_nothing(backend: str, mode: str,
                                                           namespace: str) -> None:
    key = f"{backend}-idle"
    if key not in _deployments:
        if backend == "cluster":
            _deployments[key] = deploy("cluster")
        else:
            _deployments[key] = deploy(backend, **IDLE_OPTIONS[backend])
    d = _deployments[key]
    if backend == "cluster":
        for node in d.nodes:
            node.call("CONFIG", "SET", "timeout", "1")
    warm(d, namespace)
    # A close is seen at once, whatever the timeout: a long one keeps a loaded machine's
    # slow reply (CI: one read of 4 threads over 0.25 s) from counting as an error here.
    client = ac.connect(d.url, timeout=5.0, connect_timeout=5.0)
    with ac.AsyncKVCacheMapDataPipe(Source(), client, namespace=namespace) as pipe:
        first = scan(pipe, mode, {})
        time.sleep(2.5)  # the server closes every connection of ours meanwhile
        second = scan(pipe, mode, {})
        stats = pipe.stats()
    assert first.wrong == second.wrong == 0 and not first.exceptions + second.exceptions
    assert stats["errors"] == 0, stats
    assert stats["hits"] == 2 * N


FULL_BYTES = 64 * 1024  # large values, so that a few hundred fill a small store


def fill_limits(d: Deployment, policy: str) -> None:
    """A small store: a fraction of the working set fits."""
    for node in d.nodes:
        node.call("CONFIG", "SET", "maxmemory-policy", policy)
        used = int(node.call("INFO", "memory").decode().split("used_memory:")[1].split()[0])
        node.call("CONFIG", "SET", "maxmemory", str(used + 2 * 1024 * 1024))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["noeviction", "allkeys-lru"])
def test_a_full_store_costs_misses_not_errors_of_the_training(backend: str, policy: str,
                                                              namespace: str) -> None:
    key = f"{backend}-full-{policy}"
    if key not in _deployments:
        if backend.startswith("memcached"):
            _deployments[key] = deploy(backend, memory_mb=8, no_evict=policy == "noeviction")
        else:
            _deployments[key] = deploy(backend)
    d = _deployments[key]
    if not backend.startswith("memcached"):
        fill_limits(d, policy)
    n = 400  # 25 MiB of values for a store that holds a few MiB
    source = Source(n, FULL_BYTES, compute=0)
    try:
        # a full store is not a slow one: the timeout is not what this guards, and the
        # matrix's 0.25 s, under a busy CI, let the first writes time out (so the first
        # values were not the ones a noeviction store kept: a CI flake)
        client = ac.connect(d.url, timeout=5, connect_timeout=5)
        with ac.AsyncKVCacheMapDataPipe(source, client, namespace=namespace) as pipe:
            for _epoch in range(2):
                for start in range(0, n, 16):
                    batch = list(range(start, min(n, start + 16)))
                    values = pipe.__getitems__(batch)
                    assert all(right(v, i, FULL_BYTES) for i, v in zip(batch, values))
                for index in range(0, n, 7):
                    assert right(pipe[index], index, FULL_BYTES)
            # what fits is served: the first values written (noeviction keeps them), or
            # the last ones (LRU evicted the older ones): once the write-behind queue is
            # in, or the reads below may overtake the last writes (a CI flake)
            pipe.flush()
            before = pipe.stats()["hits"]
            kept = range(16) if policy == "noeviction" else range(n - 16, n)
            for index in kept:
                assert right(pipe[index], index, FULL_BYTES)
            stats = pipe.stats()
    finally:
        if not backend.startswith("memcached"):
            for node in d.nodes:
                node.call("CONFIG", "SET", "maxmemory", "0")
                node.call("FLUSHALL")
    assert stats["hits"] - before > 0
    if policy == "noeviction":
        assert stats["rejected"] > 0 and stats["writes_dropped"] > 0  # refused, counted
        assert stats["timeouts"] == stats["unavailable"] == 0
    elif backend.startswith("memcached"):
        # evictions are just misses; memcached may still refuse a rare store ("out of
        # memory storing object") when the value's slab class has no page to evict from
        # (its pages went to other classes): that is a counted rejection, never a
        # timeout or an unreachable server
        assert stats["errors"] == stats["rejected"] <= 3, stats
        assert stats["timeouts"] == stats["unavailable"] == 0
    else:
        assert stats["errors"] == 0  # evictions are just misses


# --------------------------------------------------------------------------- soak


@pytest.mark.soak
@pytest.mark.parametrize("backend", BACKENDS)
def test_soak_epochs_under_chaos(backend: str, namespace: str) -> None:
    """Opt-in (``pytest -m soak``): epochs with 4 threads while a chaos thread kills,
    restarts and degrades the store, for ASYNCCACHE_SOAK_SECONDS (default 120) each."""
    import random

    seconds = float(os.environ.get("ASYNCCACHE_SOAK_SECONDS", "120"))
    d = deployment_for(backend)
    stop = threading.Event()
    rng = random.Random(0)
    actions: list[str] = []

    def chaos() -> None:
        while not stop.wait(rng.uniform(0.2, 1.5)):
            action = rng.choice(["kill", "blackhole", "trickle", "reset", "latency", "heal"])
            actions.append(action)
            node = rng.randrange(len(d.nodes))
            if action == "kill":
                d.kill(node)
            elif action == "blackhole":
                d.proxies[node].set_blackhole(True)
            elif action == "trickle":
                d.proxies[node].set_trickle(64, 0.1)
            elif action == "reset":
                d.proxies[node].reset_all()
            elif action == "latency":
                d.proxies[node].set_latency(rng.uniform(0.01, 0.5))
            else:
                d.heal()

    pipe = ac.AsyncKVCacheMapDataPipe(Source(compute=0.001), d.connect(), namespace=namespace)
    monkey = threading.Thread(target=chaos, daemon=True)
    monkey.start()
    started = time.monotonic()
    epochs = 0
    try:
        while time.monotonic() - started < seconds:
            result = scan(pipe, "4 threads", {})
            assert result.exceptions == [] and result.wrong == 0 and result.reads == N
            assert result.worst_read <= READ_BOUND + 0.5, result.worst_read
            epochs += 1
    finally:
        stop.set()
        monkey.join()
        pipe.close(timeout=2)
        d.heal()
    assert epochs > 0 and len(actions) > 0
    recover(d, namespace)
