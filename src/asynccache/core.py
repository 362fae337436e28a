"""``AsyncKVCache``: the async core every integration stands on.

It turns user keys into store keys (namespace), values into bytes (codec, chunking for
values over the store's item limit), gathers concurrent ``get()`` calls of one loop
iteration into one multi-get (autobatching), bounds the requests in flight, writes
behind in batches, and decides what a store failure means (``on_error``).

Store key scheme (documented contract)::

    b"ac:" + namespace + b":" + key      # key: str → UTF-8, int → decimal, bytes as is

A chunked value keeps a small manifest under its key and its chunks under
``<store key>:chunk:<token>:<i>``.

Failure policy. With ``on_error="fallback"`` (default) a store failure (timeout,
connection refused/reset, undecodable bytes) is counted in :meth:`stats`, logged once
per kind, and reads return misses; after a connection failure or timeout the store is
skipped for a short, growing back-off (0.5 s doubling to 30 s) so a dead store costs
nothing per item. With ``on_error="raise"`` the :class:`~asynccache.errors.StoreError`
or :class:`~asynccache.errors.DecodeError` propagates. Errors the user must fix
(unpicklable values, keys too long, values too large with chunking off) always raise.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from .clients.base import BaseClient
from .codec import DEFAULT_CODEC, ChunkManifest, Codec, join_chunks, split_chunks
from .errors import (
    CacheError,
    ConfigError,
    DecodeError,
    KeyTooLong,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    ValueTooLarge,
)
from .stats import FailureLog, Stats

__all__ = ["MISSING", "AsyncKVCache", "Key", "OnError"]

Key = str | bytes | int
OnError = Literal["fallback", "raise"]


class _Missing:
    """Sentinel for "not given" / "not in the cache" (``None`` is a valid value)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

MAX_NAMESPACE_BYTES = 200
_BACKOFF_START = 0.5
_BACKOFF_MAX = 30.0


def encode_key(key: Key) -> bytes:
    """User key → bytes, by the documented rule."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key).encode()
    raise ConfigError(f"cache keys are str, bytes or int; got {type(key).__name__}: {key!r}")


def check_namespace(namespace: str | None) -> str:
    """Validate a namespace; ``None`` becomes ``"default"``."""
    if namespace is None:
        return "default"
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"namespace must be a non-empty str, got {namespace!r}")
    if len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise KeyTooLong(
            f"namespace {namespace[:40]!r}... is {len(namespace.encode())} bytes; keep it under "
            f"{MAX_NAMESPACE_BYTES} (use a short name plus a version, e.g. 'imagenet-v3')"
        )
    return namespace


class AsyncKVCache:
    """Object cache over a byte store client, for use inside one event loop.

    ``ttl`` is in seconds (``None``: no expiry). ``max_key_size`` bounds the store key
    (namespace + key) in bytes. ``max_in_flight`` bounds concurrent store reads.
    ``max_pending_writes`` bounds the write-behind queue: when the store cannot keep
    up, the oldest pending writes are dropped (and counted) instead of growing memory.
    """

    def __init__(
        self,
        client: BaseClient[Any],
        namespace: str | None = None,
        ttl: float | None = None,
        codec: Codec | None = None,
        on_error: OnError = "fallback",
        *,
        chunking: bool = True,
        max_key_size: int = 1024,
        max_in_flight: int = 4,
        max_pending_writes: int = 10_000,
    ) -> None:
        if not isinstance(client, BaseClient):
            raise ConfigError(
                f"client must come from asynccache.connect(url), got {type(client).__name__}"
            )
        if on_error not in ("fallback", "raise"):
            raise ConfigError(f"on_error must be 'fallback' or 'raise', got {on_error!r}")
        if ttl is not None and ttl <= 0:
            raise ConfigError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        self.client = client
        self.namespace = check_namespace(namespace)
        self.ttl = ttl
        self.codec = codec if codec is not None else DEFAULT_CODEC
        self.on_error: OnError = on_error
        self.chunking = chunking
        self.max_key_size = max_key_size
        self.max_pending_writes = max_pending_writes
        self._prefix = b"ac:" + self.namespace.encode() + b":"
        self._max_in_flight = max_in_flight
        self._stats = Stats()
        self._failures = FailureLog()
        self._down_until = 0.0
        self._backoff = _BACKOFF_START
        self._loop_state: _LoopState | None = None

    # -- loop-bound state -------------------------------------------------------------
    def _ls(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._loop_state
        if state is None or state.loop is not loop:
            state = self._loop_state = _LoopState(loop, self._max_in_flight)
        return state

    async def __aenter__(self) -> AsyncKVCache:
        self.client.retain()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Flush pending writes and release the client; its connections in this loop
        close when no other cache or pipe still uses them."""
        await self.flush()
        await self.client.release()

    # -- keys -------------------------------------------------------------------------
    def key(self, key: Key) -> bytes:
        """The store key for ``key`` (see the module docstring for the scheme)."""
        store_key = self._prefix + encode_key(key)
        if len(store_key) > self.max_key_size:
            raise KeyTooLong(
                f"store key for {key!r} is {len(store_key)} bytes, over max_key_size="
                f"{self.max_key_size}; hash long keys yourself or raise max_key_size"
            )
        return store_key

    # -- failure handling -------------------------------------------------------------
    def _store_is_down(self) -> bool:
        return self.on_error == "fallback" and time.monotonic() < self._down_until

    def _store_failed(self, operation: str, exc: CacheError) -> None:
        """Count and log a store failure; raise it in ``raise`` mode."""
        self._stats["errors"] += 1
        if isinstance(exc, StoreTimeout):
            self._stats["timeouts"] += 1
        elif isinstance(exc, StoreUnavailable):
            self._stats["unavailable"] += 1
        elif isinstance(exc, DecodeError):
            self._stats["decode_errors"] += 1
        now = time.monotonic()
        if isinstance(exc, StoreTimeout | StoreUnavailable) and now >= self._down_until:
            # a new failure, not another request of the same burst: back off, longer
            # each time a probe after the back-off fails too
            self._down_until = now + self._backoff
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
        if self.on_error == "raise":
            raise exc
        self._failures.report(operation, exc, self.client.safe_url)

    def _store_ok(self) -> None:
        self._backoff = _BACKOFF_START

    # -- reads ------------------------------------------------------------------------
    async def _read_raw(self, store_keys: list[bytes]) -> list[bytes | None] | None:
        """Blobs for ``store_keys``, or ``None`` when the store failed (fallback)."""
        if self._store_is_down():
            self._stats["skipped"] += len(store_keys)
            return None
        ls = self._ls()
        started = time.perf_counter()
        try:
            async with ls.in_flight:
                blobs = await self.client.get_many(store_keys)
        except StoreError as exc:
            self._store_failed("get", exc)
            return None
        self._store_ok()
        self._stats["batches"] += 1
        self._stats["batch_time_us"] += int((time.perf_counter() - started) * 1e6)
        return blobs

    async def fetch(self, store_keys: list[bytes], *, failed_as_none: bool = False
                    ) -> list[Any] | None:
        """Decoded values for store keys, ``MISSING`` where absent or unusable.

        The low-level read used by :meth:`get_many` and the prefetcher: one batched
        request, chunked values resolved with one more, hits/misses counted. With
        ``failed_as_none``, a failed (or skipped) request returns None instead of
        misses, so read-ahead can tell "not there" from "could not ask".
        """
        blobs = await self._read_raw(store_keys)
        if blobs is None and failed_as_none:
            return None
        self._stats["keys_requested"] += len(store_keys)
        if blobs is None:
            return self.count_hits([MISSING] * len(store_keys))
        out, manifests = self.decode_blobs(store_keys, blobs)
        if manifests:
            await self.resolve_chunks(store_keys, manifests, out)
        return self.count_hits(out)

    def decode_blobs(self, store_keys: Sequence[bytes], blobs: Sequence[bytes | None]
                     ) -> tuple[list[Any], dict[int, ChunkManifest]]:
        """Decode one multi-get reply: values (MISSING for absent or undecodable ones)
        and the chunk manifests still to resolve. No I/O: any thread may call it."""
        out: list[Any] = [MISSING] * len(blobs)
        manifests: dict[int, ChunkManifest] = {}
        decode = self.codec.decode
        nbytes = 0
        for i, blob in enumerate(blobs):
            if blob is None:
                continue
            nbytes += len(blob)
            try:
                value = decode(blob)
            except DecodeError as exc:
                self._store_failed("decode", DecodeError(f"key {store_keys[i]!r}: {exc}"))
                continue
            if type(value) is ChunkManifest:
                manifests[i] = value
            else:
                out[i] = value
        self._stats["bytes_read"] += nbytes
        return out, manifests

    def count_hits(self, values: list[Any]) -> list[Any]:
        misses = sum(1 for v in values if v is MISSING)  # `is`: values may be arrays
        hits = len(values) - misses
        self._stats["hits"] += hits
        self._stats["misses"] += misses
        return values

    async def resolve_chunks(self, store_keys: Sequence[bytes],
                             manifests: dict[int, ChunkManifest], out: list[Any]) -> None:
        """Replace ``out[i]`` by the joined value of each manifest (one request for all
        chunks; a missing or damaged chunk leaves the miss in place)."""
        plan = {i: _chunk_keys(store_keys[i], m) for i, m in manifests.items()}
        all_keys = [k for keys in plan.values() for k in keys]
        blobs = await self._read_raw(all_keys)
        if blobs is None:
            return
        pos = 0
        for i, keys in plan.items():
            parts = blobs[pos : pos + len(keys)]
            pos += len(keys)
            if any(p is None for p in parts):
                continue  # a chunk was evicted: the whole value is a miss
            try:
                out[i] = self.codec.decode(join_chunks(parts, manifests[i]))  # type: ignore[arg-type]
            except DecodeError as exc:
                self._store_failed("decode", DecodeError(f"key {store_keys[i]!r}: {exc}"))

    async def get_many(self, keys: Iterable[Key]) -> dict[Key, Any]:
        """``{key: value}`` for the keys found; misses are simply absent."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        values = await self.fetch([self.key(k) for k in keys])
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
            self._stats["coalesced"] += 1
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
            values = await self.fetch(keys)
        except BaseException as exc:  # every waiter must be resolved on every path
            error = exc if isinstance(exc, Exception) else CacheError("cache read was cancelled")
            for waiters in pending.values():
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        for key, value in zip(keys, values):
            for fut in pending[key]:
                if not fut.done():
                    fut.set_result(value)

    # -- writes -----------------------------------------------------------------------
    def encode_entries(self, mapping: Mapping[bytes, Any]) -> dict[bytes, bytes]:
        """Store-ready ``{store key: blob}`` for ``{store key: value}``, chunked if needed.

        Pure (no I/O, no loop state), so it may run in any thread. Raises
        :class:`~asynccache.errors.EncodeError` / ``ValueTooLarge`` for the user to fix.
        """
        limit = self.client.max_value_size
        entries: dict[bytes, bytes] = {}
        for store_key, value in mapping.items():
            blob = self.codec.encode(value)
            if limit is None or len(blob) <= limit:
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
            entries[store_key] = self.codec.encode_manifest(manifest)
            self._stats["chunked_values"] += 1
        return entries

    async def write_entries(self, entries: Mapping[bytes, bytes], ttl: Any = MISSING) -> bool:
        """Write encoded entries now; ``False`` when the store failed (fallback)."""
        if not entries:
            return True
        if self._store_is_down():
            self._stats["writes_dropped"] += len(entries)
            return False
        ttl = self.ttl if ttl is MISSING else ttl
        try:
            await self.client.set_many(entries, ttl)
        except StoreError as exc:
            self._stats["writes_dropped"] += len(entries)
            self._store_failed("set", exc)
            return False
        self._store_ok()
        self._stats["sets"] += len(entries)
        self._stats["set_batches"] += 1
        self._stats["bytes_written"] += sum(len(v) for v in entries.values())
        return True

    async def set_many(self, mapping: Mapping[Key, Any], ttl: Any = MISSING) -> None:
        """Store every pair now (``ttl``: seconds, ``None`` for none, default the cache's)."""
        entries = self.encode_entries({self.key(k): v for k, v in mapping.items()})
        await self.write_entries(entries, ttl)

    async def set(self, key: Key, value: Any, ttl: Any = MISSING) -> None:
        await self.set_many({key: value}, ttl)

    def write_behind(self, entries: Mapping[bytes, bytes]) -> None:
        """Queue encoded entries; a background task writes them in batches.

        Must be called from the cache's loop (use ``loop.call_soon_threadsafe`` from
        other threads). :meth:`flush` waits until everything queued so far is written.
        """
        ls = self._ls()
        ls.writes.update(entries)
        overflow = len(ls.writes) - self.max_pending_writes
        if overflow > 0:
            for key in list(ls.writes)[:overflow]:
                del ls.writes[key]
            self._stats["writes_dropped"] += overflow
        if ls.writer is None or ls.writer.done():
            ls.writer = ls.spawn(self._drain_writes(ls))

    async def _drain_writes(self, ls: _LoopState) -> None:
        while ls.writes:
            batch_keys = list(itertools.islice(ls.writes, self.client.max_batch * 4))
            batch = {k: ls.writes.pop(k) for k in batch_keys}
            await self.write_entries(batch)

    async def flush(self) -> None:
        """Wait for queued write-behind entries to reach the store (or be dropped)."""
        state = self._loop_state
        if state is None or state.loop is not asyncio.get_running_loop():
            return
        while state.writer is not None and not state.writer.done():
            await asyncio.shield(state.writer)

    async def delete_many(self, keys: Iterable[Key]) -> None:
        store_keys = [self.key(k) for k in keys]
        try:
            await self.client.delete_many(store_keys)
        except StoreError as exc:
            self._store_failed("delete", exc)

    async def delete(self, key: Key) -> None:
        await self.delete_many([key])

    async def get_or_compute(self, key: Key, compute: Callable[[], Any],
                             ttl: Any = MISSING) -> Any:
        """The cached value, or ``compute()`` (sync or async) stored and returned.

        Concurrent calls for the same key in this loop compute once.
        """
        value = await self.get(key, MISSING)
        if value is not MISSING:
            return value
        ls = self._ls()
        store_key = self.key(key)
        running = ls.computing.get(store_key)
        if running is not None:
            return await asyncio.shield(running)
        task = ls.loop.create_task(self._compute_and_store(key, compute, ttl))
        ls.computing[store_key] = task
        task.add_done_callback(lambda _t: ls.computing.pop(store_key, None))
        return await asyncio.shield(task)

    async def _compute_and_store(self, key: Key, compute: Callable[[], Any], ttl: Any) -> Any:
        result = compute()
        if inspect.isawaitable(result):
            result = await result
        await self.set(key, result, ttl)
        return result

    # -- stats ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, errors, timeouts, batches, bytes_read, sets, ..."""
        return self._stats.snapshot()

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter (integrations keep their own counters here too)."""
        self._stats[name] += n

    def __repr__(self) -> str:
        return f"AsyncKVCache({self.client!r}, namespace={self.namespace!r}, ttl={self.ttl!r})"


class _LoopState:
    """What a cache holds per event loop: coalescing buffer, tasks, write queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_in_flight: int) -> None:
        self.loop = loop
        self.in_flight = asyncio.Semaphore(max_in_flight)
        self.pending: dict[bytes, list[asyncio.Future[Any]]] = {}
        self.flush_scheduled = False
        self.tasks: set[asyncio.Task[Any]] = set()
        self.writes: dict[bytes, bytes] = {}
        self.writer: asyncio.Task[None] | None = None
        self.computing: dict[bytes, asyncio.Task[Any]] = {}

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


def _chunk_keys(store_key: bytes, manifest: ChunkManifest) -> list[bytes]:
    stem = store_key + b":chunk:" + manifest.token.encode() + b":"
    return [stem + str(i).encode() for i in range(manifest.chunks)]

