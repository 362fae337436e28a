"""``AsyncKVCache``: the async core every integration stands on, in one event loop.

It holds a cache's settings and parts, and delegates: store keys to its `Keyspace`, reads to
`ReadPath`, writes to `Writer` (and its one queue), leases to `Leases`, concurrent callers
to `coalesce`, every store failure to the one `FailurePolicy`. Its parts may be used from
any thread where they say so (decoding, encoding, counters); the async methods run in one
loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NoReturn

from ..errors import CacheError, ClosedError, StoreError
from ..observe.histogram import Histograms, Latency
from ..observe.stats import Counters, with_hit_rate
from ..store.api import BaseClient, NodeName
from . import decorator
from .coalesce import Computed, SharedComputation
from .codec import Codec
from .expiry import check_ttl
from .health import FailurePolicy, OnError
from .keys import DEFAULT_MAX_KEY_SIZE, Keyspace
from .l1 import L1Cache
from .leases import Leases
from .loops import Loops
from .markers import MISSING, Failed
from .parts import CacheParts
from .reads import IMMUTABLE, ReadPath
from .settings import CacheSettings, SettingsView
from .write_queue import WriteQueue
from .writes import Writer

__all__ = ["AsyncKVCache", "Key", "OnError"]

Key = Any  # int-like, str, bytes or tuples of them: see asynccache.cache.keys
#: ``condition(result) -> bool``: whether a computed result is stored
Condition = decorator.Condition


class AsyncKVCache(SettingsView):
    """Object cache over a byte store client, for use inside one event loop.

    With ``lease``, the first process to miss a key takes a short lease on it in the
    store (Redis ``SET NX PX``, memcached ``add``, for a whole batch in one round trip),
    computes and writes it; the others wait for its value (polling, at most ``lease``
    seconds) instead of computing it again. A holder that dies lets its lease expire and
    the next waiter takes it. Hits cost nothing extra; store trouble during any of it
    means "compute here". A lease must outlast what it covers: one compute here, and in
    a pipe a whole batch's misses (computed one after another, then written together).

    Args:
        client: a store client from `asynccache.connect()`.
        namespace: the versioned name values are stored under (``"svc-v1"``), to reuse
            them across runs and jobs. Without one the cache gets a namespace of its own,
            whose values expire after a day.
        ttl: seconds (or a ``datetime.timedelta``) values live in the store; ``None``:
            no expiry (an unnamed namespace: a day).
        codec: how values become bytes (default ``Codec()``).
        on_error: ``"fallback"`` (default: a store failure is a counted miss, logged
            once) or ``"raise"``.
        chunking: split values larger than the store's item size into chunks (off: such
            a value is a ``ValueTooLarge``).
        max_key_size: bound on the store key (namespace + key), in bytes.
        max_in_flight: bound on concurrent store reads.
        max_pending_writes: bound on the write-behind queue: when the store cannot keep
            up, the oldest pending writes are dropped (and counted) instead of growing
            memory.
        lease: seconds (off by default): see above.
        l1_bytes: an in-process LRU of this many bytes of encoded values in front of the
            store (hits counted as ``l1_hits``).
    """

    def __init__(
        self,
        client: BaseClient[Any],
        namespace: str | Keyspace | None = None,
        ttl: float | timedelta | None = None,
        codec: Codec | None = None,
        on_error: OnError = "fallback",
        *,
        chunking: bool = True,
        max_key_size: int = DEFAULT_MAX_KEY_SIZE,
        max_in_flight: int = 4,
        max_pending_writes: int = 10_000,
        lease: Any = None,
        l1_bytes: int | None = None,
    ) -> None:
        keyspace = (namespace if isinstance(namespace, Keyspace)
                    else Keyspace(namespace, max_key_size))
        self._build(CacheSettings(client, keyspace, ttl, codec, on_error, lease, l1_bytes,
                                  chunking, max_in_flight, max_pending_writes))

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> AsyncKVCache:
        """A cache built from settings checked already (a pipe's or a node's, in each
        process that uses it)."""
        cache = cls.__new__(cls)
        cache._build(settings)
        return cache

    def _build(self, settings: CacheSettings) -> None:
        #: what this cache was built from, checked once; `keyspace`, `ttl`, `codec` and
        #: the other settings are read from it, never kept twice
        self.settings = settings
        client = settings.client
        self.counters = Counters()
        #: durations of store requests (one record per request, never per item)
        self.histograms = Histograms()
        self.policy = FailurePolicy(settings.on_error, self.counters, client.safe_url)
        #: the in-process tier in front of the store (``l1_bytes``), fed by every decode
        self.l1 = L1Cache(settings.l1_bytes) if settings.l1_bytes else None
        #: values written behind and not yet acknowledged (read-your-writes asks it)
        self.writes = WriteQueue(settings.max_pending_writes, ttl=settings.store_ttl)
        #: the state held in the running loop; ``get()`` calls gather into the read path
        self.loops = Loops(settings.max_in_flight, self.counters, self._refuse)
        #: what the mechanisms below (and a pipe's consumer threads) take
        self.parts = CacheParts(
            client=client, keyspace=settings.keyspace, codec=settings.checked_codec,
            ttl=settings.store_ttl, lease=settings.lease, chunking=settings.chunking,
            counters=self.counters, histograms=self.histograms, policy=self.policy,
            l1=self.l1, writes=self.writes, loops=self.loops)
        self.reads = ReadPath(self.parts)
        self.loops.gather_into(self.reads.read, self.reads.copy_of)
        self.writer = Writer(self.parts)
        self.leases = Leases(self.parts, self.reads)

    def __getstate__(self) -> NoReturn:
        raise TypeError(
            f"{self!r} cannot be pickled: a cache belongs to the event loop it runs in. "
            "Pickle its client (configuration only, it connects in each process) and build "
            "a cache there, or use AsyncKVCacheMapDataPipe, which does that in each process")

    # -- the loop, and the end ------------------------------------------------------------
    def _refuse(self) -> NoReturn:
        raise ClosedError(f"{self!r} was used after aclose(): build a new AsyncKVCache (its "
                          "stats() still gives this one's final counters)")

    async def __aenter__(self) -> AsyncKVCache:
        self.loops.check_open()
        self.client.retain()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Flush pending writes and release the client; its connections in this loop
        close when no other cache or pipe still uses them. The cache is then closed: using
        it raises `ClosedError` (``stats()`` still answers);
        closing twice does nothing."""
        if self.loops.closed:
            return
        await self.flush()
        self.loops.closed = True
        await self.client.release()

    # -- keys -----------------------------------------------------------------------------
    def key(self, key: Key) -> bytes:
        """The store key for ``key`` (see `asynccache.cache.keys` for the scheme)."""
        return self.keyspace.key(key)

    def resolve_ttl(self, ttl: Any) -> float | None:
        """A call's ``ttl`` (``MISSING``: the cache's), checked by the one TTL rule."""
        return self.ttl if ttl is MISSING else self.keyspace.ttl(check_ttl(ttl))

    # -- reads ------------------------------------------------------------------------------
    async def get_many(self, keys: Iterable[Key]) -> dict[Key, Any]:
        """``{key: value}`` for the keys found; misses are simply absent."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        values = await self.reads.read([self.key(k) for k in keys])
        for value in values:
            if type(value) is Failed:
                raise value.error
        return {k: v for k, v in zip(keys, values) if v is not MISSING}

    async def get(self, key: Key, default: Any = None) -> Any:
        """One value, or ``default``. Concurrent calls in one loop tick share one request."""
        store_key = self.key(key)
        value = await self.loops.here().gets.get(store_key)
        return default if value is MISSING else value

    # -- writes -----------------------------------------------------------------------------
    async def set_many(self, mapping: Mapping[Key, Any],
                       ttl: float | timedelta | type[MISSING] | None = MISSING) -> None:
        """Store every pair now.

        Args:
            mapping: ``{key: value}``; each value is encoded by the cache's codec.
            ttl: seconds or a ``datetime.timedelta``, ``None`` for no expiry; default
                the cache's.
        """
        ttl = self.resolve_ttl(ttl)
        entries = self.writer.encode_entries({self.key(k): v for k, v in mapping.items()})
        await self.write_entries(entries, ttl)

    async def set(self, key: Key, value: Any,
                  ttl: float | timedelta | type[MISSING] | None = MISSING) -> None:
        """Store one value now (``ttl`` as for `set_many()`)."""
        await self.set_many({key: value}, ttl)

    async def write_entries(self, entries: Mapping[bytes, bytes],
                            ttl: float | timedelta | type[MISSING] | None = MISSING) -> bool:
        """Write encoded entries now (see `Writer.write_entries()`)."""
        self.loops.check_open()
        return await self.writer.write_entries(entries, self.resolve_ttl(ttl))

    async def flush(self) -> None:
        """Wait for queued write-behind entries to reach the store (or be dropped)."""
        if not self.loops.closed:  # aclose() flushed them
            await self.writer.flush()

    async def delete_many(self, keys: Iterable[Key]) -> None:
        """Remove ``keys`` from the store; missing keys are ignored."""
        self.loops.check_open()
        await self.invalidate_store_keys([self.key(k) for k in keys])

    async def delete(self, key: Key) -> None:
        """Remove one key from the store."""
        await self.delete_many([key])

    # -- computing --------------------------------------------------------------------------
    async def get_or_compute(self, key: Key, compute: Callable[[], Any],
                             ttl: float | timedelta | type[MISSING] | None = MISSING) -> Any:
        """The cached value, or ``compute()`` stored and returned.

        Concurrent calls for the same key in this loop compute once; with ``lease``, so
        do calls in other processes. Every caller gets an object of its own.

        Args:
            key: the cache key.
            compute: called with no arguments on a miss; sync or async.
            ttl: as for `set_many()`.
        """
        return await self.compute_once(self.key(key), compute, self.resolve_ttl(ttl))

    async def compute_once(self, store_key: bytes, compute: Callable[[], Any],
                           ttl: float | None, condition: Condition | None = None) -> Any:
        """`get_or_compute()` by store key (``ttl`` already resolved): what the decorator
        calls. ``condition(result)`` false: the result is returned, not stored.

        A computation in flight is joined without a read. A read that misses while a
        computation of the key finished meanwhile (its request left before that
        computation's write was acknowledged, so the store could not have had it) takes that
        computation's value instead of computing again: `LoopState.finished` keeps it
        reachable for exactly such reads."""
        here = self.loops.here()
        shared = here.computing.get(store_key)
        if shared is None:
            mark = here.finishes
            here.readers += 1
            try:
                value = await here.gets.get(store_key)
                if value is not MISSING:
                    return value
                shared = here.computing.get(store_key) or here.finished_since(store_key, mark)
            finally:
                here.readers -= 1
                if not here.readers:
                    here.finished.clear()  # no read is left that could have missed a write
            if shared is None:
                task: asyncio.Task[Computed] = here.loop.create_task(
                    self._compute_and_store(store_key, compute, ttl, condition))
                shared = here.computing[store_key] = SharedComputation(task, store_key)
                task.add_done_callback(functools.partial(here.done, store_key, shared))
        return await shared.result(self.codec.decode)

    async def _compute_and_store(self, store_key: bytes, compute: Callable[[], Any],
                                 ttl: float | None, condition: Condition | None
                                 ) -> Computed:
        if self.lease is None:
            return await self._compute_write(store_key, compute, ttl, condition)
        outcome = await self.leases.run([store_key], functools.partial(
            self._compute_leased, store_key, compute, ttl, condition))
        if store_key in outcome.computed:
            return outcome.computed[store_key]  # type: ignore[no-any-return]
        return self.snapshot(store_key, outcome.found[store_key])

    async def _compute_leased(self, store_key: bytes, compute: Callable[[], Any],
                              ttl: float | None, condition: Condition | None,
                              leased: list[bytes]) -> dict[bytes, Computed]:
        """The lease protocol's `ComputeMine` step for one key: compute and write it, then
        drop its lease -- after a failure too, or the retry here or elsewhere waits the
        lease out."""
        try:
            computed = await self._compute_write(store_key, compute, ttl, condition)
        except Exception:  # a compute that raised (or a write, under on_error="raise")
            await self.leases.release(leased)
            raise
        except BaseException:
            # cancelled (or an interrupt): not awaited here, so the cancellation is not
            # delayed by a round trip; the release runs as a task of its own
            self.loops.here().spawn(self.leases.release(leased))
            raise
        await self.leases.release(leased)
        return {store_key: computed}

    async def _compute_write(self, store_key: bytes, compute: Callable[[], Any],
                             ttl: float | None, condition: Condition | None) -> Computed:
        result = compute()
        if inspect.isawaitable(result):
            result = await result
        if condition is not None and not condition(result):
            return self.snapshot(store_key, result)
        blobs = self.writer.encode_values({store_key: result})
        await self.write_entries(self.writer.entries_for(blobs), ttl)
        return Computed(result, None if type(result) in IMMUTABLE else blobs[store_key])

    def snapshot(self, store_key: bytes, value: Any) -> Computed:
        """``value`` with the bytes its other callers decode their own objects from, made
        now, before any caller can change it in place."""
        if type(value) in IMMUTABLE:
            return Computed(value, None)
        try:
            return Computed(value, self.codec.encode(value, store_key))
        except CacheError as exc:
            return Computed(value, None, exc)

    async def invalidate_store_keys(self, store_keys: Sequence[bytes]) -> None:
        """Delete ``store_keys`` everywhere this cache keeps them: the store (both tiers of
        a `Tiered` client), the L1 tier, this process's read-your-writes record and the
        values of computations just finished (so no read can get them back)."""
        self.loops.check_open()
        self.forget(store_keys)
        try:
            await self.client.delete_many(list(store_keys))
        except StoreError as exc:
            self.policy.failed(NodeName(self.client.safe_url), "delete", exc)
            if self.policy.strict:
                raise

    def forget(self, store_keys: Iterable[bytes]) -> None:
        """Drop what this process holds for ``store_keys`` besides the store."""
        store_keys = list(store_keys)
        if self.l1 is not None:
            self.l1.discard(store_keys)
        self.writes.discard(store_keys)
        here = self.loops.last
        if here is not None:
            for store_key in store_keys:
                here.finished.pop(store_key, None)

    def cached(self, fn: Callable[..., Any] | None = None, *,
               ttl: float | timedelta | type[MISSING] | None = MISSING,
               key: Callable[..., Any] | None = None, noself: bool = False,
               condition: Condition | None = None) -> Any:
        """Decorator: cache what an async function returns, ``@cache.cached(ttl=60)``
        (or bare ``@cache.cached``); the reference is docs/async-services.md.

        Concurrent calls with the same arguments compute once and each caller gets an
        object of its own. A plain function works too (the wrapper is async). The wrapper
        has ``key(*args, **kwargs)`` (a call's store key) and ``await invalidate(*args,
        **kwargs)`` (that call's entry deleted).

        Args:
            fn: the function (given when used bare, ``@cache.cached``).
            ttl: as for `set_many()`.
            key: ``key(*args, **kwargs)`` returns a call's key (under the cache's key
                encoding, as for `get()`); default: the function's identity and its
                arguments (defaults applied) under the call-key encoding of
                docs/formats.md, exact over types.
            noself: a method's instances share entries (its class still joins the key);
                without it a method's instance must have ``__cache_key__()``.
            condition: ``condition(result) -> bool``: whether a result is stored (it is
                returned either way).
        """
        if fn is None:
            return lambda f: decorator.cached(self, f, ttl, key, noself, condition)
        return decorator.cached(self, fn, ttl, key, noself, condition)

    def cached_many(self, fn: Callable[..., Any] | None = None, *,
                    ttl: float | timedelta | type[MISSING] | None = MISSING,
                    key: Callable[..., Any] | None = None, noself: bool = False) -> Any:
        """Decorator for a batch function ``async def f(ids, *rest) -> {id: value}``: the
        hits come from one multi-get, ``f`` is called once with only the missing ids (in
        their order), its results are written in one batch; concurrent calls compute each
        id once; ids ``f`` leaves out are not stored (and absent from the result).

        Args:
            fn: the function (given when used bare).
            ttl: as for `set_many()`.
            key: ``key(id, *rest, **kwargs)`` returns one id's key (as for `cached()`).
            noself: as for `cached()`.
        """
        if fn is None:
            return lambda f: decorator.cached_many(self, f, ttl, key, noself)
        return decorator.cached_many(self, fn, ttl, key, noself)

    # -- stats ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters: hits, misses, errors, timeouts, batches, bytes_read, sets, ...; two
        sizes: ``unstored_values`` (values kept here because the store lacks them: their
        write failed or was dropped) and ``kept_bytes`` (the read-your-writes record's
        memory); and ``hit_rate``, hits / (hits + misses + recalled), a float."""
        return with_hit_rate(self.counts())

    def counts(self) -> dict[str, int]:
        """`stats()` without ``hit_rate``: ints only (what is summed and published)."""
        total = self.counters.snapshot()
        total["unstored_values"] = self.writes.unstored_values
        total["kept_bytes"] = self.writes.kept_bytes
        return total

    def latency(self) -> dict[str, Latency]:
        """Durations of store requests, ``{"read": Latency, "write": Latency}``: one
        record per multi-get or write request (its wait for a free in-flight slot not
        included), in the fixed buckets of `asynccache.observe.histogram`. Requests
        that failed count too (a timeout took its time); requests never sent (every node
        backing off) do not."""
        return self.histograms.snapshot()

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter (integrations keep their own counters here too)."""
        self.counters.add(name, n)

    def __repr__(self) -> str:
        return f"AsyncKVCache({self.client!r}, namespace={self.namespace!r}, ttl={self.ttl!r})"
