"""``AsyncKVCache``: the async core every integration stands on.

It turns user keys into store keys (namespace, :mod:`asynccache.cache.keys`), values into
bytes bound to their key (codec, chunking for values over the store's item limit),
gathers concurrent ``get()`` calls of one loop iteration into one multi-get
(autobatching), bounds the requests in flight, writes behind in batches bounded in
bytes, and reports every store failure to the one
:class:`~asynccache.cache.health.FailurePolicy` (count, back off per node, log once, fall
back or raise).

Store key scheme (documented contract)::

    b"ac:" + namespace + b":" + encode_key(key)     # see asynccache.cache.keys (Keyspace)

A chunked value keeps a small manifest under its key and its chunks under keys of their
own, in the same namespace (:func:`asynccache.cache.keys.chunk_keys`).

Markers that travel with values between the layers (never returned to users):
``MISSING`` (not in the store, or unusable: compute it), ``NOT_READ`` (the store was not
asked or did not answer: read-ahead drops it, a direct read treats it as ``MISSING``)
and :class:`Failed` (raise mode: this key's bytes failed to decode; raised where it is
consumed).

Thread use: the async methods run in one event loop. :meth:`decode_blobs`,
:meth:`encode_entries`, :meth:`stats` and the failure policy may be called from any
thread (counters are per-thread shards; see :mod:`asynccache.observe.stats`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from .. import _fork
from ..errors import (
    CacheError,
    ClosedError,
    ConfigError,
    DecodeError,
    FormatMismatch,
    StoreError,
    StoreTimeout,
    ValueTooLarge,
)
from ..observe.histogram import Histograms, Latency
from ..observe.stats import Counters
from ..store.api import BaseClient, WriteResult
from .codec.codec import DEFAULT_CODEC, ChunkManifest, Codec, join_chunks, split_chunks
from .expiry import check_ttl
from .health import FailurePolicy, OnError
from .keys import DEFAULT_MAX_KEY_SIZE, Keyspace, chunk_keys, lease_key
from .l1 import L1Cache
from .markers import MISSING, NOT_READ, Failed, is_value
from .writes import Batch, WriteQueue

__all__ = ["AsyncKVCache", "Key", "OnError", "check_settings"]

Key = Any  # int-like, str, bytes or tuples of them: see asynccache.cache.keys

#: Bytes per write request: a request must fit in ``timeout`` (a 50 MB batch is not one
#: 1-second request), and reads queue behind less.
WRITE_REQUEST_BYTES = 8 * 1024 * 1024
#: How often a process waiting on another's lease looks for the value: from the first
#: to the last delay, growing by half each time (a value usually lands within a compute).
LEASE_POLL = (0.005, 0.1)

logger = logging.getLogger("asynccache")

#: Values no reader can change in place: handed to every reader as they are.
_IMMUTABLE = frozenset({bool, int, float, complex, str, bytes, type(None)})


def check_settings(client: Any, on_error: Any, lease: Any, l1_bytes: Any) -> None:
    """Raise ConfigError for settings a cache, a pipe or a node cannot use (said in the
    caller, at construction, not later in a DataLoader worker)."""
    if not isinstance(client, BaseClient):
        raise ConfigError(
            f"client must come from asynccache.connect(url), got {type(client).__name__}"
        )
    if on_error not in ("fallback", "raise"):
        raise ConfigError(f"on_error must be 'fallback' or 'raise', got {on_error!r}")
    if l1_bytes is not None and (type(l1_bytes) is not int or l1_bytes <= 0):
        raise ConfigError(f"l1_bytes must be a positive int (bytes of encoded values "
                          f"kept in this process) or None, got {l1_bytes!r}")
    if lease is not None:
        check_ttl(lease, "lease (the longest one batch of misses may take to compute, in "
                         "seconds)")


class AsyncKVCache:
    """Object cache over a byte store client, for use inside one event loop.

    ``ttl`` is in seconds (``None``: no expiry). ``max_key_size`` bounds the store key
    (namespace + key) in bytes. ``max_in_flight`` bounds concurrent store reads.
    ``max_pending_writes`` bounds the write-behind queue: when the store cannot keep
    up, the oldest pending writes are dropped (and counted) instead of growing memory.

    ``lease`` (seconds, off by default): on a miss, the first process to miss a key
    takes a short lease on it in the store (Redis ``SET NX PX``, memcached ``add``, for a
    whole batch in one round trip), computes and writes it; the others wait for its
    value (polling, at most ``lease`` seconds) instead of computing it again. A holder
    that dies lets its lease expire and the next waiter takes it. Hits cost nothing
    extra; store trouble during any of it means "compute here". A lease must outlast
    what it covers: one compute here, and in a pipe a whole batch's misses (computed
    one after another, then written together).
    """

    def __init__(
        self,
        client: BaseClient[Any],
        namespace: str | Keyspace | None = None,
        ttl: Any = None,
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
        check_settings(client, on_error, lease, l1_bytes)
        self.client = client
        #: the namespace and its key rule (a pipe or node passes its own, so that the
        #: cache of each of its copies builds the same keys)
        self.keyspace = (namespace if isinstance(namespace, Keyspace)
                         else Keyspace(namespace, max_key_size))
        self.namespace = self.keyspace.namespace
        self.ttl = self.keyspace.ttl(check_ttl(ttl))
        self.codec = codec if codec is not None else DEFAULT_CODEC
        self.on_error: OnError = on_error
        self.chunking = chunking
        self.max_key_size = self.keyspace.max_key_size
        self.max_pending_writes = max_pending_writes
        self.lease = check_ttl(lease, "lease")
        #: the in-process tier in front of the store (``l1_bytes``), fed by every decode
        self.l1 = L1Cache(l1_bytes) if l1_bytes else None
        self.prefix = self.keyspace.prefix
        #: values written behind and not yet acknowledged (read-your-writes asks it)
        self.writes = WriteQueue(max_pending_writes)
        self._max_in_flight = max_in_flight
        self.counters = Counters()
        #: durations of store requests (one record per request, never per item)
        self.histograms = Histograms()
        self.policy = FailurePolicy(on_error, self.counters, client.safe_url)
        self._loop_state: _LoopState | None = None
        self._closed = False

    # -- loop-bound state -------------------------------------------------------------
    def _ls(self) -> _LoopState:
        if self._closed:
            self._refuse()
        loop = asyncio.get_running_loop()
        state = self._loop_state
        if state is None or state.loop is not loop:
            state = self._loop_state = _LoopState(loop, self._max_in_flight)
        return state

    def _refuse(self) -> None:
        raise ClosedError(f"{self!r} was used after aclose(): build a new AsyncKVCache (its "
                          "stats() still gives this one's final counters)")

    async def __aenter__(self) -> AsyncKVCache:
        if self._closed:
            self._refuse()
        self.client.retain()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Flush pending writes and release the client; its connections in this loop
        close when no other cache or pipe still uses them. The cache is then closed: using
        it raises :class:`~asynccache.errors.ClosedError` (``stats()`` still answers);
        closing twice does nothing."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        await self.client.release()

    # -- keys -------------------------------------------------------------------------
    def key(self, key: Key) -> bytes:
        """The store key for ``key`` (see :mod:`asynccache.cache.keys` for the scheme)."""
        return self.keyspace.key(key)

    def _ttl(self, ttl: Any) -> float | None:
        """A call's ``ttl`` (``MISSING``: the cache's), checked by the one TTL rule."""
        return self.ttl if ttl is MISSING else self.keyspace.ttl(check_ttl(ttl))

    def copy_of(self, store_key: bytes, value: Any) -> Any:
        """An object of its own with ``value``'s content, as a second reader of the same
        key gets it: encoded and decoded again (only where a key repeats)."""
        if value is None or type(value) in _IMMUTABLE:
            return value
        return self.codec.decode(self.codec.encode(value, store_key), store_key)

    # -- reads ------------------------------------------------------------------------
    async def read_blobs(self, store_keys: Sequence[bytes]
                         ) -> tuple[list[Any], StoreError | None]:
        """Raw values for ``store_keys`` (``None`` absent, ``NOT_READ`` not read) and the
        first store failure, already counted and logged. Never raises for the store."""
        ls = self._ls()
        policy = self.policy
        started = time.perf_counter_ns()
        async with ls.in_flight:
            sent = time.perf_counter_ns()
            result = await self.client.read(store_keys, policy.down())
        done = time.perf_counter_ns()
        if result.answered or result.failures:  # a request left (not every node skipped)
            self.histograms.record("read", done - sent)
        counters = self.counters.shard()
        counters["batches"] += 1
        counters["keys_requested"] += len(store_keys)
        counters["batch_time_us"] += (done - started) // 1000
        for node in result.answered:
            policy.succeeded(node)
        if result.skipped:
            policy.skipped(result.skipped)
        error = None
        for node, exc in result.failures.items():
            policy.failed(node, "get", exc)
            error = error or exc
        return result.values, error

    def decode_blobs(self, store_keys: Sequence[bytes], blobs: Sequence[Any],
                     second_look: bool = False
                     ) -> tuple[list[Any], dict[int, ChunkManifest], int]:
        """Decode one multi-get reply: a value per key (``MISSING`` for absent or unusable
        bytes, ``NOT_READ`` passed through, :class:`Failed` in raise mode), the chunk
        manifests still to resolve, and the bytes the reply carried (what read-ahead
        sizes its requests by). No I/O: any thread may call it. ``second_look``: keys
        this process read a moment ago (see :meth:`claim`); bytes that fail to decode
        were counted and logged then, and are a plain ``MISSING`` now."""
        out: list[Any] = [MISSING] * len(blobs)
        manifests: dict[int, ChunkManifest] = {}
        decode = self.codec.decode
        l1 = self.l1
        nbytes = 0
        for i, blob in enumerate(blobs):
            if blob is None:
                continue
            if blob is NOT_READ:
                out[i] = NOT_READ
                continue
            nbytes += len(blob)
            try:
                value = decode(blob, store_keys[i])
            except DecodeError as exc:
                out[i] = MISSING if second_look else self._decode_failed(store_keys[i], exc)
                continue
            if type(value) is ChunkManifest:
                manifests[i] = value  # MISSING until its chunks are read
            else:
                out[i] = value
                if l1 is not None:
                    l1.put(store_keys[i], bytes(blob))
        self.counters.shard()["bytes_read"] += nbytes
        return out, manifests, nbytes

    def from_l1(self, store_keys: Sequence[bytes]) -> tuple[list[Any], list[int]]:
        """Values the L1 tier holds (decoded afresh, ``NOT_READ`` where it has none) and
        the positions it had nothing for. Any thread."""
        l1 = self.l1
        if l1 is None:
            return [NOT_READ] * len(store_keys), list(range(len(store_keys)))
        values: list[Any] = [NOT_READ] * len(store_keys)
        missing = []
        decode = self.codec.decode
        for i, key in enumerate(store_keys):
            blob = l1.get(key)
            if blob is None:
                missing.append(i)
                continue
            try:
                values[i] = decode(blob, key)
            except DecodeError:  # cannot happen for bytes we decoded before; be safe
                missing.append(i)
        hits = len(store_keys) - len(missing)
        if hits:
            self.counters.shard()["l1_hits"] += hits
        return values, missing

    def _decode_failed(self, store_key: bytes, exc: DecodeError) -> Any:
        error = type(exc)(f"key {store_key!r}: {exc}")
        self.policy.decode_failed(error)
        if self.policy.strict and not isinstance(exc, FormatMismatch):
            return Failed(error)
        return MISSING

    async def resolve_chunks(self, store_keys: Sequence[bytes],
                             manifests: dict[int, ChunkManifest], out: list[Any],
                             second_look: bool = False) -> None:
        """Replace ``out[i]`` by the joined value of each manifest (one request for all
        chunks; a missing or damaged chunk leaves the miss in place)."""
        plan = {i: _chunk_keys(store_keys[i], m) for i, m in manifests.items()}
        all_keys = [k for keys in plan.values() for k in keys]
        blobs, _error = await self.read_blobs(all_keys)
        pos = 0
        for i, keys in plan.items():
            parts = blobs[pos : pos + len(keys)]
            pos += len(keys)
            if any(p is None or p is NOT_READ for p in parts):
                continue  # a chunk was evicted (or not read): the whole value is a miss
            try:
                joined = join_chunks(parts, manifests[i])
                out[i] = self.codec.decode(joined, store_keys[i])
            except DecodeError as exc:
                out[i] = MISSING if second_look else self._decode_failed(store_keys[i], exc)
                continue
            if self.l1 is not None:
                self.l1.put(store_keys[i], joined)

    async def read_values(self, store_keys: Sequence[bytes],
                          sizes: list[int] | None = None, second_look: bool = False
                          ) -> tuple[list[Any], StoreError | None]:
        """Decoded values (with the markers of the module docstring) and the first store
        failure. The whole read path of the loop thread; never raises for the store.
        Keys the L1 tier holds are not asked for. ``sizes`` gets the bytes the store's
        reply carried appended (read-ahead sizes its requests by them). ``second_look``:
        see :meth:`decode_blobs`."""
        if self.l1 is not None:
            values, missing = self.from_l1(store_keys)
            if not missing:
                return values, None
            if len(missing) < len(store_keys):
                asked = [store_keys[i] for i in missing]
                found, error = await self.read_values_from_store(asked, sizes, second_look)
                for i, value in zip(missing, found):
                    values[i] = value
                return values, error
        return await self.read_values_from_store(store_keys, sizes, second_look)

    async def read_values_from_store(self, store_keys: Sequence[bytes],
                                     sizes: list[int] | None = None,
                                     second_look: bool = False
                                     ) -> tuple[list[Any], StoreError | None]:
        blobs, error = await self.read_blobs(store_keys)
        values, manifests, nbytes = self.decode_blobs(store_keys, blobs, second_look)
        if sizes is not None:
            sizes.append(nbytes)
        if manifests:
            await self.resolve_chunks(store_keys, manifests, values, second_look)
        return values, error

    def _outcomes(self, values: list[Any], error: StoreError | None) -> list[Any]:
        """Markers → what a caller gets, counting hits and misses: ``MISSING`` for a
        miss; in raise mode :class:`Failed` for a key whose node failed or whose bytes
        did not decode (the caller raises it)."""
        strict = self.policy.strict
        hits = misses = 0
        for i, value in enumerate(values):
            if value is MISSING or value is NOT_READ:
                if strict and value is NOT_READ and error is not None:
                    values[i] = Failed(error)
                    continue
                values[i] = MISSING
                misses += 1
            elif type(value) is not Failed:
                hits += 1
        counters = self.counters.shard()
        counters["hits"] += hits
        counters["misses"] += misses
        return values

    async def get_many(self, keys: Iterable[Key]) -> dict[Key, Any]:
        """``{key: value}`` for the keys found; misses are simply absent."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        values = self._outcomes(*await self.read_values([self.key(k) for k in keys]))
        for value in values:
            if type(value) is Failed:
                raise value.error
        return {k: v for k, v in zip(keys, values) if v is not MISSING}

    async def get(self, key: Key, default: Any = None) -> Any:
        """One value, or ``default``. Concurrent calls in one loop tick share one request."""
        store_key = self.key(key)
        ls = self._ls()
        fut: asyncio.Future[Any] = ls.loop.create_future()
        waiters = ls.pending.get(store_key)
        if waiters is None:
            ls.pending[store_key] = [fut]
        else:
            waiters.append(fut)
            self.counters.shard()["coalesced"] += 1
        if not ls.flush_scheduled:
            ls.flush_scheduled = True
            ls.loop.call_soon(self._flush_gets, ls)
        value = await fut
        return default if value is MISSING else value

    def _flush_gets(self, ls: _LoopState) -> None:
        pending, ls.pending, ls.flush_scheduled = ls.pending, {}, False
        if pending:
            ls.spawn(self._resolve_gets(pending))

    async def _resolve_gets(self, pending: dict[bytes, list[asyncio.Future[Any]]]) -> None:
        keys = list(pending)
        try:
            values = self._outcomes(*await self.read_values(keys))
        except BaseException as exc:  # every waiter must be resolved on every path
            failure = exc if isinstance(exc, Exception) else CacheError("cache read was cancelled")
            for waiters in pending.values():
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            return
        for key, value in zip(keys, values):
            given = False
            for fut in pending[key]:
                if fut.done():
                    continue
                if type(value) is Failed:
                    fut.set_exception(value.error)
                elif not given or value is MISSING:
                    fut.set_result(value)
                    given = True
                else:  # coalesced callers of one key: each gets an object of its own
                    try:
                        fut.set_result(self.copy_of(key, value))
                    except CacheError as exc:
                        fut.set_exception(exc)

    # -- writes -----------------------------------------------------------------------
    def encode_values(self, mapping: Mapping[bytes, Any]) -> dict[bytes, bytes]:
        """``{store key: blob}`` for ``{store key: value}``: each value encoded whole, bound
        to its key. Pure (no I/O, no loop state), so it may run in any thread. Raises
        :class:`~asynccache.errors.EncodeError` for the user to fix."""
        encode = self.codec.encode
        blobs = {store_key: encode(value, store_key) for store_key, value in mapping.items()}
        if self.l1 is not None:
            for store_key, blob in blobs.items():
                self.l1.put(store_key, blob)  # a computed item reused soon is an L1 hit
        return blobs

    def entries_for(self, blobs: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
        """Store-ready entries for encoded values: a value over the store's item limit
        becomes its chunks and, last, a manifest under its own key (so that a writer
        that writes entries in order has written every chunk when the manifest lands).
        ``ValueTooLarge`` when chunking is off."""
        limit = self.client.max_value_size
        if limit is None or all(len(b) <= limit for b in blobs.values()):
            return dict(blobs)
        entries: dict[bytes, bytes] = {}
        for store_key, blob in blobs.items():
            if len(blob) <= limit:
                entries[store_key] = blob
                continue
            if not self.chunking:
                raise ValueTooLarge(
                    f"value for {store_key!r} is {len(blob)} bytes, over the store's limit of "
                    f"{limit}; enable chunking=True or raise the server's item size"
                )
            chunk_size = max(limit - 64, 1024)
            manifest = ChunkManifest.for_blob(blob, chunk_size)
            parts = split_chunks(blob, chunk_size)
            for chunk_key, part in zip(_chunk_keys(store_key, manifest), parts):
                entries[chunk_key] = bytes(part)
            entries[store_key] = self.codec.encode_manifest(manifest, store_key)
            self.counters.shard()["chunked_values"] += 1
        return entries

    def encode_entries(self, mapping: Mapping[bytes, Any]) -> dict[bytes, bytes]:
        """Store-ready ``{store key: blob}`` for ``{store key: value}``, chunked if needed
        (:meth:`encode_values` then :meth:`entries_for`). Any thread."""
        return self.entries_for(self.encode_values(mapping))

    async def write_entries(self, entries: Mapping[bytes, bytes], ttl: Any = MISSING) -> bool:
        """Write encoded entries now, in requests of at most WRITE_REQUEST_BYTES.

        True when every entry was written; failures are counted, logged once and, in
        raise mode, raised (the first of them).
        """
        if self._closed:
            self._refuse()
        ttl = self._ttl(ttl)
        ok = True
        first_error: StoreError | None = None
        for part in _write_requests(entries, self.client.max_batch * 4):
            sent = time.perf_counter_ns()
            result = await self.client.write(part, ttl, self.policy.down())
            if result.answered or result.failures or result.rejected:
                self.histograms.record("write", time.perf_counter_ns() - sent)
            if not self._count_write(part, result):
                ok = False
                first_error = first_error or next(
                    iter((*result.failures.values(), *result.rejected.values())), None)
        if first_error is not None and self.policy.strict:
            raise first_error
        return ok

    def _count_write(self, part: Mapping[bytes, bytes], result: WriteResult) -> bool:
        policy = self.policy
        counters = self.counters.shard()
        for node in result.answered:
            policy.succeeded(node)
        for node, exc in result.failures.items():
            if isinstance(exc, StoreTimeout) and len(part) == 1:
                size = len(next(iter(part.values())))
                exc = StoreTimeout(
                    f"{exc} — a single {size / 2**20:.1f} MiB value did not fit in "
                    f"timeout={self.client.timeout:g}s: raise timeout= in connect() (this "
                    "value needs more than that at this link's speed) or it is never cached")
            policy.failed(node, "set", exc)
        for _key, exc in result.rejected.items():
            policy.failed(self.client.safe_url, "set", exc)
        dropped = result.failed_keys + len(result.rejected) + result.skipped
        counters["writes_dropped"] += dropped
        if result.written:
            counters["sets"] += result.written
            counters["set_batches"] += 1
            counters["bytes_written"] += sum(len(v) for v in part.values())
        return dropped == 0

    async def set_many(self, mapping: Mapping[Key, Any], ttl: Any = MISSING) -> None:
        """Store every pair now (``ttl``: seconds or a timedelta, ``None`` for none,
        default the cache's)."""
        ttl = self._ttl(ttl)
        entries = self.encode_entries({self.key(k): v for k, v in mapping.items()})
        await self.write_entries(entries, ttl)

    async def set(self, key: Key, value: Any, ttl: Any = MISSING) -> None:
        await self.set_many({key: value}, ttl)

    def write_later(self, blobs: Mapping[bytes, bytes]) -> bool:
        """Queue encoded values (``{store key: blob}``) for write-behind, from any thread.

        Until the store acknowledges them, :meth:`recall` hands them back. True when
        the loop's writer must be started: call :meth:`start_writer` in the cache's loop
        (``loop.call_soon_threadsafe`` from another thread)."""
        wake, dropped = self.writes.put(blobs, self.entries_for(blobs))
        if dropped:
            self.counters.shard()["writes_dropped"] += dropped
        return wake

    def write_behind(self, blobs: Mapping[bytes, bytes]) -> None:
        """:meth:`write_later` from the cache's own loop. :meth:`flush` waits until
        everything queued so far is written."""
        self.write_later(blobs)
        self.start_writer()

    def start_writer(self) -> None:
        """Start this loop's writer if entries are queued and none is at work (loop)."""
        ls = self._ls()
        if (ls.writer is None or ls.writer.done()) and len(self.writes):
            ls.writer = ls.spawn(self._drain_writes())

    async def _drain_writes(self) -> None:
        writes, max_keys = self.writes, self.client.max_batch * 4
        while (batch := writes.take(max_keys)) is not None:
            try:
                await self._write_batch(batch)
            finally:
                writes.done(batch)

    async def _write_batch(self, batch: Batch) -> None:
        try:
            await self.write_entries(batch.entries)
        except StoreError:
            pass  # raise mode: counted by the policy; nobody waits on write-behind

    async def flush(self) -> None:
        """Wait for queued write-behind entries to reach the store (or be dropped)."""
        if self._closed:
            return  # aclose() flushed them
        state = self._loop_state
        if state is None or state.loop is not asyncio.get_running_loop():
            if not len(self.writes):
                return
            state = self._ls()
        self.start_writer()
        while state.writer is not None and not state.writer.done():
            await asyncio.shield(state.writer)
            self.start_writer()  # queued meanwhile by another thread

    def recall(self, store_keys: Sequence[bytes]) -> tuple[dict[bytes, Any], list[bytes]]:
        """For keys that missed: values this process wrote and the store has not
        acknowledged (decoded afresh: an object of their own), and the keys acknowledged
        lately, which the store now holds (read them again rather than compute them).
        Any thread; only misses ask."""
        blobs, again = self.writes.recall(store_keys)
        found: dict[bytes, Any] = {}
        decode = self.codec.decode
        for key, blob in blobs.items():
            try:
                found[key] = decode(blob, key)
            except DecodeError:  # bytes this process encoded: cannot happen; be safe
                again.append(key)
        if found:
            self.counters.shard()["recalled"] += len(found)
        return found, again

    async def delete_many(self, keys: Iterable[Key]) -> None:
        if self._closed:
            self._refuse()
        store_keys = [self.key(k) for k in keys]
        try:
            await self.client.delete_many(store_keys)
        except StoreError as exc:
            self.policy.failed(self.client.safe_url, "delete", exc)
            if self.policy.strict:
                raise

    async def delete(self, key: Key) -> None:
        await self.delete_many([key])

    async def get_or_compute(self, key: Key, compute: Callable[[], Any],
                             ttl: Any = MISSING) -> Any:
        """The cached value, or ``compute()`` (sync or async) stored and returned.

        Concurrent calls for the same key in this loop compute once; with ``lease``, so
        do calls in other processes. Every caller gets an object of its own.
        """
        ttl = self._ttl(ttl)
        value = await self.get(key, MISSING)
        if value is not MISSING:
            return value
        ls = self._ls()
        store_key = self.key(key)
        shared = ls.computing.get(store_key)
        if shared is None:
            task = ls.loop.create_task(self._compute_and_store(key, store_key, compute, ttl))
            shared = ls.computing[store_key] = _Shared(task)
            task.add_done_callback(lambda _t: ls.computing.pop(store_key, None))
        value = await asyncio.shield(shared.task)
        if shared.taken:  # another caller has this object: this one gets its own
            return self.copy_of(store_key, value)
        shared.taken = True
        return value

    async def _compute_and_store(self, key: Key, store_key: bytes,
                                 compute: Callable[[], Any], ttl: Any) -> Any:
        if self.lease is not None:
            found, _mine, theirs = await self.claim([store_key])
            if not found and theirs:
                found, _now_mine = await self.wait_for_values(theirs)
            if store_key in found:
                return found[store_key]
        result = compute()
        if inspect.isawaitable(result):
            result = await result
        await self.set(key, result, ttl)
        if self.lease is not None:
            await self.release_leases([store_key])
        return result

    def cached(self, fn: Callable[..., Any] | None = None, *, ttl: Any = MISSING,
               key: Callable[..., Any] | None = None) -> Any:
        """Decorator: cache what an async function returns, ``@cache.cached(ttl=60)``
        (or bare ``@cache.cached``). The key is the function's qualified name and its
        arguments (defaults applied) under the documented key encoding, or
        ``key(*args, **kwargs)``; concurrent calls with the same arguments compute once
        and each caller gets an object of its own. A plain function works too (the
        wrapper is async). See :mod:`asynccache.cache.decorator`."""
        from .decorator import cached

        if fn is None:
            return lambda f: cached(self, f, ttl, key)
        return cached(self, fn, ttl, key)

    # -- leases -----------------------------------------------------------------------
    @property
    def lease_token(self) -> bytes:
        """What this process writes into the leases it holds (pid + random: who holds it)."""
        made = getattr(self, "_lease_token", None)
        if made is None or made[0] != _fork.generation:  # a forked child: a token of its own
            token = b"%d:%s" % (os.getpid(), secrets.token_hex(8).encode())
            made = self._lease_token = (_fork.generation, token)
        return made[1]

    async def claim(self, store_keys: Sequence[bytes]
                    ) -> tuple[dict[bytes, Any], list[bytes], list[bytes]]:
        """Take the lease on each missing key (one round trip), then look once more for
        the values of the keys taken (one more): ``(found, mine, theirs)``.

        A holder writes its value before it drops its lease, so a lease found free may
        be that of a value written since this process missed the key -- computing it
        would be the work the lease exists to save (a waiter that read just before the
        holder's write took the freed lease and computed a whole batch again). ``found``:
        those values (their fresh leases dropped); ``mine``: keys this process computes;
        ``theirs``: keys another process holds. Store trouble, or a store without
        leases: every key is ``mine`` (the lease only saves work; it is never worth a
        wrong or missing value)."""
        taken = await self._add_leases(store_keys)
        if taken is None:
            return {}, list(store_keys), []
        got = [k for k, ok in zip(store_keys, taken) if ok]
        theirs = [k for k, ok in zip(store_keys, taken) if not ok]
        if not got:
            return {}, [], theirs
        values, _error = await self.read_values(got, second_look=True)  # trouble: what was read
        found = {k: v for k, v in zip(got, values) if is_value(v)}
        counters = self.counters.shard()
        if not found:
            counters["leases"] += len(got)
            return {}, got, theirs
        await self.release_leases(list(found))
        mine = [k for k in got if k not in found]
        counters["leases"] += len(mine)
        counters["lease_hits"] += len(found)
        return found, mine, theirs

    async def _add_leases(self, store_keys: Sequence[bytes]) -> list[bool] | None:
        """``add_many`` of our token on each key's lease: True where it was free. None
        when leases cannot be taken now (store trouble, a node backing off, or a store
        without them): a miss then costs what it costs without ``lease=``, never a round
        trip to a node known to be down."""
        if self.lease is None or not store_keys or self.policy.down():
            return None
        token = self.lease_token
        try:
            taken = await self.client.add_many({lease_key(k): token for k in store_keys},
                                               self.lease)
        except NotImplementedError as exc:
            if self.policy.log.first("lease", exc):
                logger.warning("asynccache: %s cannot take leases (%s): lease= is ignored, "
                               "every process computes its own misses", self.client.safe_url,
                               exc)
            return None
        except StoreError as exc:
            self.policy.failed(self.client.safe_url, "lease", exc)
            return None
        return taken

    async def release_leases(self, store_keys: Sequence[bytes]) -> None:
        """Drop our leases once the values are written (waiters see the value first; a
        write that failed lets a waiter take the lease at once instead of at expiry)."""
        if self.lease is None or not store_keys or self.policy.down():
            return  # a node backing off: the leases expire on their own
        try:
            await self.client.delete_many([lease_key(k) for k in store_keys])
        except StoreError as exc:
            self.policy.failed(self.client.safe_url, "lease", exc)

    async def wait_for_values(self, store_keys: Sequence[bytes], deadline: float | None = None
                              ) -> tuple[dict[bytes, Any], list[bytes]]:
        """Values of keys other processes hold leases on: polled until each one arrives,
        or its lease is free again (its holder died or gave up: then it is this
        process's to compute), or the deadline (default: ``lease`` seconds from now, plus
        the store's expiry slack: memcached expires whole seconds).

        Returns the values found and the keys this process must now compute.
        """
        if deadline is None:
            deadline = time.monotonic() + (self.lease or 0.0) + self.client.expiry_slack
        counters = self.counters.shard()
        counters["lease_waits"] += len(store_keys)
        found: dict[bytes, Any] = {}
        mine: list[bytes] = []
        pending = list(store_keys)
        delay, longest = LEASE_POLL
        while pending:
            values, error = await self.read_values(pending, second_look=True)
            still = []
            for key, value in zip(pending, values):
                if is_value(value):
                    found[key] = value
                else:
                    still.append(key)
            counters["lease_hits"] += len(pending) - len(still)
            if error is not None:  # the store is in trouble: compute the rest here
                mine += still
                break
            if not still:
                break
            more, got, pending = await self.claim(still)  # free again: the holder is gone
            found.update(more)
            mine += got
            remaining = deadline - time.monotonic()
            if pending and remaining <= 0:
                counters["lease_timeouts"] += len(pending)
                mine += pending
                break
            if pending:
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 1.5, longest)
        return found, mine

    # -- stats ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, errors, timeouts, batches, bytes_read, sets, ..."""
        return self.counters.snapshot()

    def latency(self) -> dict[str, Latency]:
        """Durations of store requests, ``{"read": Latency, "write": Latency}``: one
        record per multi-get or write request (its wait for a free in-flight slot not
        included), in the fixed buckets of :mod:`asynccache.observe.histogram`. Requests that
        failed count too (a timeout took its time); requests never sent (every node
        backing off) do not."""
        return self.histograms.snapshot()

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter (integrations keep their own counters here too)."""
        self.counters.add(name, n)

    def __repr__(self) -> str:
        return f"AsyncKVCache({self.client!r}, namespace={self.namespace!r}, ttl={self.ttl!r})"


class _Shared:
    """One computation that several callers await; the first to take its result gets
    the object, the others copies of it."""

    __slots__ = ("taken", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.taken = False


class _LoopState:
    """What a cache holds per event loop: coalescing buffer, tasks, the writer task."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_in_flight: int) -> None:
        self.loop = loop
        self.in_flight = asyncio.Semaphore(max_in_flight)
        self.pending: dict[bytes, list[asyncio.Future[Any]]] = {}
        self.flush_scheduled = False
        self.tasks: set[asyncio.Task[Any]] = set()
        self.writer: asyncio.Task[None] | None = None
        self.computing: dict[bytes, _Shared] = {}

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


def _chunk_keys(store_key: bytes, manifest: ChunkManifest) -> list[bytes]:
    return chunk_keys(store_key, manifest.token, manifest.chunks)


def _write_requests(entries: Mapping[bytes, bytes], max_keys: int
                    ) -> Iterable[dict[bytes, bytes]]:
    """``entries`` cut into requests of at most ``max_keys`` keys and about
    WRITE_REQUEST_BYTES bytes (a larger single value is a request of its own)."""
    part: dict[bytes, bytes] = {}
    size = 0
    for key, blob in entries.items():
        n = len(blob)
        if part and (size + n > WRITE_REQUEST_BYTES or len(part) >= max_keys):
            yield part
            part, size = {}, 0
        part[key] = blob
        size += n
    if part:
        yield part

