"""What asynccache is compared with: the same values on the same server, read by peers.

Every peer reads values stored as ``pickle.dumps(value, protocol=5)`` under its own plain
keys and unpickles each hit, so it does the least a cache of Python objects must do:

* ``dict + pickle.loads`` -- an in-process dict of the pickled values, the floor of
  ``InMemoryCacheHolder`` when values are not kept as live objects (no server at all);
* naive, one round trip per item: ``redis.Redis.get`` (hiredis) or ``pymemcache`` ``get``;
* floor, the hand-written batched client: a ``redis.asyncio`` ``MGET`` loop or
  ``aiomcache`` ``multi_get``, on uvloop, ``in_flight`` batches outstanding;
* ``aiocache`` ``multi_get`` (``RedisCache`` / ``MemcachedCache`` with its
  ``PickleSerializer``), the same shape.

Values are written and deleted with the synchronous clients (setup, not timed).
"""

from __future__ import annotations

import pickle
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiomcache
import redis
import redis.asyncio as aioredis
from aiocache import MemcachedCache, RedisCache
from aiocache.serializers import PickleSerializer
from pymemcache.client.base import (
    Client as PymemcacheClient,
)

from ._common import (
    Case,
    Store,
    UvloopRunner,
    batches_of,
    chunks_by_bytes,
    run_workers,
    time_async_batches,
    time_items,
)

__all__ = [
    "Peers",
    "delete_keys",
    "dict_case",
    "hand_written_mget",
    "naive_sync_get",
    "peers_for",
    "write_plain",
]


def dict_case(blobs: Sequence[bytes], n: int, item_bytes: int, group: int) -> Case:
    """``pickle.loads(d[i])`` for i in 0..n-1: no server, no I/O."""
    table = dict(enumerate(blobs[:n]))
    loads = pickle.loads

    def get(i: int) -> Any:
        return loads(table[i])

    return Case(
        "dict + pickle.loads",
        "dict",
        n,
        item_bytes,
        group,
        lambda: time_items(get, range(n)),
    )


# ----------------------------------------------------------------------- setup (untimed)


def _pymemcache(store: Store) -> PymemcacheClient:
    return PymemcacheClient((store.host, store.port), connect_timeout=5, timeout=30, no_delay=True)


def write_plain(
    store: Store, keys: Sequence[str], blobs: Sequence[bytes], ttl: float | None
) -> None:
    """Store ``blobs`` under ``keys`` as they are (the peers' keyspace)."""
    pairs = list(zip(keys, blobs))
    if store.protocol == "redis":
        r = redis.Redis.from_url(store.url, socket_timeout=60)
        try:
            for chunk in chunks_by_bytes(pairs):
                pipe = r.pipeline(transaction=False)
                for key, blob in chunk:
                    pipe.set(key, blob, ex=None if ttl is None else int(ttl))
                pipe.execute()
        finally:
            r.close()
        return
    mc = _pymemcache(store)
    try:
        for chunk in chunks_by_bytes(pairs):
            failed = mc.set_many(dict(chunk), expire=int(ttl or 0), noreply=False)
            if failed:
                raise RuntimeError(f"memcached refused {len(failed)} values, e.g. {failed[0]!r}")
    finally:
        mc.close()


def delete_keys(store: Store, keys: Sequence[bytes | str]) -> None:
    """Remove what a benchmark wrote (both keyspaces); missing keys are fine."""
    if store.protocol == "redis":
        r = redis.Redis.from_url(store.url, socket_timeout=60)
        try:
            for chunk in batches_of(list(keys), 1000):
                r.delete(*chunk)
        finally:
            r.close()
        return
    mc = _pymemcache(store)
    try:
        for chunk in batches_of(list(keys), 1000):
            mc.delete_many(list(chunk), noreply=False)
    finally:
        mc.close()


# ------------------------------------------------------------------------------ readers


class Peers:
    """The three networked peers of one protocol, with clients open on one store."""

    naive_name: str
    floor_name: str
    aiocache_name = "aiocache multi_get"

    def __init__(self, store: Store, runner: UvloopRunner, in_flight: int) -> None:
        self.store = store
        self.runner = runner
        self.in_flight = in_flight

    def naive(self, keys: Sequence[str], n: int, item_bytes: int, group: int) -> Case:
        bkeys = [k.encode() for k in keys[:n]]
        get = self._sync_get()
        loads = pickle.loads

        def one(i: int) -> Any:
            blob = get(bkeys[i])
            return None if blob is None else loads(blob)

        return Case(
            self.naive_name,
            "naive",
            n,
            item_bytes,
            group,
            lambda: time_items(one, range(n)),
        )

    def floor(self, keys: Sequence[str], n: int, item_bytes: int, batch: int) -> Case:
        batches = batches_of([k.encode() for k in keys[:n]], batch)
        one = self._multi_get()
        return Case(
            self.floor_name,
            "floor",
            n,
            item_bytes,
            batch,
            lambda: self.runner.run(time_async_batches(one, batches, self.in_flight)),
            {"in_flight": self.in_flight},
        )

    def aiocache(self, keys: Sequence[str], n: int, item_bytes: int, batch: int) -> Case:
        batches = batches_of(list(keys[:n]), batch)
        cache = self._aiocache()

        async def one(batch_keys: Sequence[str]) -> int:
            values = await cache.multi_get(list(batch_keys))
            return sum(1 for v in values if v is not None)

        return Case(
            self.aiocache_name,
            "aiocache",
            n,
            item_bytes,
            batch,
            lambda: self.runner.run(time_async_batches(one, batches, self.in_flight)),
            {"in_flight": self.in_flight},
        )

    # -- per protocol
    def _sync_get(self) -> Any:
        raise NotImplementedError

    def _multi_get(self) -> Any:
        raise NotImplementedError

    def _aiocache(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class RedisPeers(Peers):
    naive_name = "redis-py GET per key"
    floor_name = "redis.asyncio MGET loop"

    def __init__(self, store: Store, runner: UvloopRunner, in_flight: int) -> None:
        super().__init__(store, runner, in_flight)
        self._sync: redis.Redis | None = None
        self._async: aioredis.Redis | None = None
        self._aiocaches: list[RedisCache] = []

    def _sync_get(self) -> Any:
        if self._sync is None:
            self._sync = redis.Redis.from_url(self.store.url)
        return self._sync.get

    def _multi_get(self) -> Any:
        if self._async is None:
            # redis.asyncio with its default pool: a connection per request in flight
            self._async = aioredis.Redis.from_url(self.store.url)
        return mget_decoded(self._async)

    def _aiocache(self) -> RedisCache:
        s = self.store
        cache = RedisCache(
            serializer=PickleSerializer(),
            endpoint=s.host,
            port=s.port,
            db=s.db,
            password=s.password,
        )
        self._aiocaches.append(cache)
        return cache

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
        clients = [c.client for c in self._aiocaches]
        if self._async is not None:
            clients.append(self._async)

        async def close_all() -> None:
            for client in clients:
                # aclose(), not aiocache's close(): redis-py 5+ deprecates Redis.close()
                await client.aclose()
                await client.connection_pool.disconnect()

        self.runner.run(close_all())


class MemcachedPeers(Peers):
    naive_name = "pymemcache get per key"
    floor_name = "aiomcache multi_get"

    def __init__(self, store: Store, runner: UvloopRunner, in_flight: int) -> None:
        super().__init__(store, runner, in_flight)
        self._sync: PymemcacheClient | None = None
        self._asyncs: list[aiomcache.Client] = []
        self._aiocaches: list[MemcachedCache] = []

    def _sync_get(self) -> Any:
        if self._sync is None:
            self._sync = _pymemcache(self.store)
        return self._sync.get

    def _multi_get(self) -> Any:
        mc = aiomcache.Client(self.store.host, self.store.port, pool_size=self.in_flight)
        self._asyncs.append(mc)
        loads: Callable[[Any], Any] = pickle.loads  # values are bytes (no decode_responses)

        async def one(batch: Sequence[bytes]) -> int:
            values = await mc.multi_get(*batch)
            hits = {k: loads(v) for k, v in zip(batch, values) if v is not None}
            return len(hits)

        return one

    def _aiocache(self) -> MemcachedCache:
        cache = MemcachedCache(
            serializer=PickleSerializer(),
            endpoint=self.store.host,
            port=self.store.port,
            pool_size=self.in_flight,
        )
        self._aiocaches.append(cache)
        return cache

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()

        async def close_all() -> None:
            for mc in self._asyncs:
                await mc.close()
            for cache in self._aiocaches:
                await cache.close()

        self.runner.run(close_all())


def peers_for(store: Store, runner: UvloopRunner, in_flight: int) -> Peers:
    cls = RedisPeers if store.protocol == "redis" else MemcachedPeers
    return cls(store, runner, in_flight)


# ------------------------------------------- throughput floors (core and datapipe modules)


async def hand_written_mget(
    r: aioredis.Redis, key_batches: Sequence[Sequence[bytes]], in_flight: int = 4
) -> int:
    """The fair floor: MGET per batch, ``in_flight`` requests outstanding, pickle.loads.

    It does what asynccache's ``get_many`` does minus the codec header/checksum,
    namespacing, stats and misses bookkeeping: a dict of decoded hits per batch.
    """
    return await run_workers(key_batches, in_flight, mget_decoded(r))


def mget_decoded(r: aioredis.Redis) -> Callable[[Sequence[bytes]], Awaitable[int]]:
    """``one(batch)``: MGET, ``pickle.loads`` of every hit into a dict; returns the hits."""
    loads: Callable[[Any], Any] = pickle.loads  # values are bytes (no decode_responses)

    async def one(batch: Sequence[bytes]) -> int:
        values = await r.mget(batch)
        hits = {k: loads(v) for k, v in zip(batch, values) if v is not None}
        return len(hits)

    return one


def naive_sync_get(r: redis.Redis, keys: Sequence[bytes]) -> int:
    """One synchronous GET round trip per item, then pickle.loads: what a naive cache does."""
    loads: Callable[[Any], Any] = pickle.loads  # values are bytes (no decode_responses)
    get = r.get
    n = 0
    for k in keys:
        v = get(k)
        if v is not None:
            loads(v)
            n += 1
    return n
