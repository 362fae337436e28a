"""Writes of a cache: now (`Writer.entries()`) or behind, through its one queue.

Any thread queues encoded values (`WriteQueue.put()`); the cache's event loop takes
them in batches (`WriteQueue.take()`), writes them and reports each batch done
(`WriteQueue.done()`). There is no second queue in front of this one.

Read your writes. Until the store acknowledged a value, the queue holds its bytes:
a read that misses a key this process wrote asks `WriteQueue.recall()`, and gets
those bytes (decoded afresh by the caller: an object of its own) instead of computing
the value again. A read sent before a write landed may come back a miss after the
write was acknowledged; the queue remembers the keys acknowledged lately (their bytes
are in the store), so such a miss is read again rather than recomputed. Hits never
look here: only misses pay for the lock.

Bounded: past ``max_pending`` values the oldest ones not yet taken are dropped
(counted as ``writes_dropped``); a value whose write failed is forgotten (while the
store is down nothing is kept: a later read computes it again).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DecodeError, StoreError, StoreTimeout
from ..store.api import STORE_COUNTS, NodeName, WriteResult
from . import chunks

if TYPE_CHECKING:
    from .core import AsyncKVCache

__all__ = ["RECENT_KEYS", "WRITE_REQUEST_BYTES", "Batch", "WriteQueue", "Writer"]

#: Bytes per write request: a request must fit in ``timeout`` (a 50 MB batch is not one
#: 1-second request), and reads queue behind less.
WRITE_REQUEST_BYTES = 8 * 1024 * 1024

#: Keys acknowledged lately that a miss reads again instead of computing. A read-ahead
#: miss waits in a prefetcher's buffer for at most a window (``4 * prefetch`` items per
#: node and thread), so a write acknowledged after it was read is among the last few
#: thousand; this bound keeps that true for windows far larger than the default.
RECENT_KEYS = 1 << 16


class Batch(NamedTuple):
    """Entries taken for one write request, and the values they complete."""

    entries: dict[bytes, bytes]
    #: value keys whose last entry is in this batch, with the bytes they were queued as
    values: dict[bytes, bytes]


class WriteQueue:
    """Queued entries (value keys, chunk keys) and the values not acknowledged yet."""

    def __init__(self, max_pending: int, recent: int = RECENT_KEYS) -> None:
        self._lock = threading.Lock()
        #: store key -> bytes to write, in queue order (chunks before their manifest)
        self._queued: dict[bytes, bytes] = {}
        #: the entry that completes a value (its own key) -> the value's whole blob
        self._values: dict[bytes, bytes] = {}
        #: value key -> its whole blob, from put() until done() (queued or in flight)
        self._unacked: dict[bytes, bytes] = {}
        self._recent: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._recent_max = recent
        self._max_pending = max_pending
        #: a writer is (or has been asked to be) at work; put() wakes one otherwise
        self._active = False

    # -- producers: any thread --------------------------------------------------------
    def put(self, values: Mapping[bytes, bytes],
            entries: Mapping[bytes, bytes]) -> tuple[bool, int]:
        """Queue ``entries`` (what to write) for ``values`` (value key -> whole blob).

        Returns ``(wake, dropped)``: whether the caller must start a writer (none is
        at work), and how many queued entries were dropped to stay bounded."""
        with self._lock:
            queued = self._queued
            for key in entries:
                queued.pop(key, None)  # a rewrite goes to the back of the queue
            queued.update(entries)
            self._values.update(values)
            self._unacked.update(values)
            dropped = 0
            overflow = len(queued) - self._max_pending
            if overflow > 0:
                for key in list(queued)[:overflow]:
                    del queued[key]
                    blob = self._values.pop(key, None)
                    if blob is not None and self._unacked.get(key) is blob:
                        del self._unacked[key]
                dropped = overflow
            wake = not self._active
            self._active = True
        return wake, dropped

    # -- the writer: the cache's loop ---------------------------------------------------
    def take(self, max_keys: int) -> Batch | None:
        """Up to ``max_keys`` queued entries, oldest first; None (and the writer's turn
        ends) when nothing is queued."""
        with self._lock:
            queued = self._queued
            if not queued:
                self._active = False
                return None
            keys = list(queued)[:max_keys]
            entries = {k: queued.pop(k) for k in keys}
            values = {k: self._values.pop(k) for k in keys if k in self._values}
        return Batch(entries, values)

    def done(self, batch: Batch) -> None:
        """The store answered for ``batch`` (written or failed): its values are no
        longer this queue's to hand out; their keys are remembered as acknowledged."""
        recent, unacked = self._recent, self._unacked
        with self._lock:
            for key, blob in batch.values.items():
                if unacked.get(key) is blob:  # not queued again since
                    del unacked[key]
                recent[key] = None
                recent.move_to_end(key)
            while len(recent) > self._recent_max:
                recent.popitem(last=False)

    # -- readers: any thread, on a miss -------------------------------------------------
    def recall(self, keys: Iterable[bytes]) -> tuple[dict[bytes, bytes], list[bytes]]:
        """For keys that missed: the blobs of those this process wrote and the store has
        not acknowledged, and the keys acknowledged lately (read them again)."""
        found: dict[bytes, bytes] = {}
        again: list[bytes] = []
        with self._lock:
            if not self._unacked and not self._recent:
                return found, again
            for key in keys:
                blob = self._unacked.get(key)
                if blob is not None:
                    found[key] = blob
                elif key in self._recent:
                    again.append(key)
        return found, again

    def discard(self, keys: Iterable[bytes]) -> None:
        """Forget ``keys`` (an invalidation): their queued writes are not made, and no miss
        recalls them or reads them again for this process's sake."""
        with self._lock:
            if not (self._queued or self._unacked or self._recent):
                return
            for key in keys:
                self._queued.pop(key, None)
                self._values.pop(key, None)
                self._unacked.pop(key, None)
                self._recent.pop(key, None)

    def forget(self) -> int:
        """Drop everything queued (the loop is gone); how many entries were dropped."""
        with self._lock:
            n = len(self._queued)
            self._queued.clear()
            self._values.clear()
            self._unacked.clear()
            self._active = False
        return n

    def __len__(self) -> int:
        return len(self._queued)

    @property
    def unacknowledged(self) -> int:
        """Values queued or in flight."""
        return len(self._unacked)


class Writer:
    """The writes of one `AsyncKVCache`: values encoded
    (any thread), written now or queued behind (the cache's one `WriteQueue`,
    ``cache.writes``), counted, and read back from the queue on a miss."""

    def __init__(self, cache: AsyncKVCache) -> None:
        self.cache = cache

    # -- encoding: any thread ------------------------------------------------------------
    def encode_values(self, mapping: Mapping[bytes, Any]) -> dict[bytes, bytes]:
        """``{store key: blob}`` for ``{store key: value}``: each value encoded whole, bound
        to its key. Pure (no I/O, no loop state), so it may run in any thread. Raises
        `EncodeError` for the user to fix."""
        cache = self.cache
        encode = cache.codec.encode
        blobs = {store_key: encode(value, store_key) for store_key, value in mapping.items()}
        if cache.l1 is not None:
            for store_key, blob in blobs.items():
                cache.l1.put(store_key, blob)  # a computed item reused soon is an L1 hit
        return blobs

    def entries_for(self, blobs: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
        """Store-ready entries for encoded values, chunked where over the store's item
        limit (`asynccache.cache.chunks.split_entries()`)."""
        cache = self.cache
        entries, chunked = chunks.split_entries(blobs, cache.client.max_value_size,
                                                cache.codec, cache.chunking)
        if chunked:
            cache.counters.shard()["chunked_values"] += chunked
        return entries

    def encode_entries(self, mapping: Mapping[bytes, Any]) -> dict[bytes, bytes]:
        """Store-ready ``{store key: blob}`` for ``{store key: value}``, chunked if needed
        (`encode_values()` then `entries_for()`). Any thread."""
        return self.entries_for(self.encode_values(mapping))

    # -- now ------------------------------------------------------------------------------
    async def write_entries(self, entries: Mapping[bytes, bytes], ttl: float | None) -> bool:
        """Write encoded entries now, in requests of at most WRITE_REQUEST_BYTES.

        True when every entry was written; failures are counted, logged once and, in
        raise mode, raised (the first of them).
        """
        cache = self.cache
        client, policy = cache.client, cache.policy
        ok = True
        first_error: StoreError | None = None
        for part in _requests(entries, client.max_batch * 4):
            sent = time.perf_counter_ns()
            counts = STORE_COUNTS.set(cache.counters.add)  # the store's own counts: ours
            try:
                result = await client.write(part, ttl, policy.down())
            finally:
                STORE_COUNTS.reset(counts)
            if result.answered or result.failures or result.rejected:
                cache.histograms.record("write", time.perf_counter_ns() - sent)
            if not self._count(part, result):
                ok = False
                first_error = first_error or next(
                    iter((*result.failures.values(), *result.rejected.values())), None)
        if first_error is not None and policy.strict:
            raise first_error
        return ok

    def _count(self, part: Mapping[bytes, bytes], result: WriteResult) -> bool:
        cache = self.cache
        policy = cache.policy
        counters = cache.counters.shard()
        for node in result.answered:
            policy.succeeded(node)
        for node, exc in result.failures.items():
            if isinstance(exc, StoreTimeout) and len(part) == 1:
                size = len(next(iter(part.values())))
                exc = StoreTimeout(
                    f"{exc} — a single {size / 2**20:.1f} MiB value did not fit in "
                    f"timeout={cache.client.timeout:g}s: raise timeout= in connect() (this "
                    "value needs more than that at this link's speed) or it is never cached")
            policy.failed(node, "set", exc)
        for _key, exc in result.rejected.items():
            policy.failed(NodeName(cache.client.safe_url), "set", exc)
        dropped = result.failed_keys + len(result.rejected) + result.skipped
        counters["writes_dropped"] += dropped
        if result.written:
            counters["sets"] += result.written
            counters["set_batches"] += 1
            counters["bytes_written"] += sum(len(v) for v in part.values())
        return dropped == 0

    # -- behind -----------------------------------------------------------------------------
    def write_later(self, blobs: Mapping[bytes, bytes]) -> bool:
        """Queue encoded values (``{store key: blob}``) for write-behind, from any thread.

        Until the store acknowledges them, `recall()` hands them back. True when
        the loop's writer must be started: call `start()` in the cache's loop
        (``loop.call_soon_threadsafe`` from another thread)."""
        cache = self.cache
        wake, dropped = cache.writes.put(blobs, self.entries_for(blobs))
        if dropped:
            cache.counters.shard()["writes_dropped"] += dropped
        return wake

    def write_behind(self, blobs: Mapping[bytes, bytes]) -> None:
        """`write_later()` from the cache's own loop. `flush()` waits until
        everything queued so far is written."""
        self.write_later(blobs)
        self.start()

    def start(self) -> None:
        """Start this loop's writer if entries are queued and none is at work (loop)."""
        cache = self.cache
        here = cache._loop()
        if (here.writer is None or here.writer.done()) and len(cache.writes):
            here.writer = here.spawn(self._drain())

    async def _drain(self) -> None:
        cache = self.cache
        writes, max_keys = cache.writes, cache.client.max_batch * 4
        while (batch := writes.take(max_keys)) is not None:
            try:
                await self.write_entries(batch.entries, cache.ttl)
            except StoreError:
                pass  # raise mode: counted by the policy; nobody waits on write-behind
            finally:
                writes.done(batch)

    async def flush(self) -> None:
        """Wait for queued write-behind entries to reach the store (or be dropped)."""
        cache = self.cache
        here = cache._loop_state
        if here is None or here.loop is not asyncio.get_running_loop():
            if not len(cache.writes):
                return
            here = cache._loop()
        self.start()
        while here.writer is not None and not here.writer.done():
            await asyncio.shield(here.writer)
            self.start()  # queued meanwhile by another thread

    def recall(self, store_keys: Sequence[bytes]) -> tuple[dict[bytes, Any], list[bytes]]:
        """For keys that missed: values this process wrote and the store has not
        acknowledged (decoded afresh: an object of their own), and the keys acknowledged
        lately, which the store now holds (read them again rather than compute them).
        Any thread; only misses ask."""
        cache = self.cache
        blobs, again = cache.writes.recall(store_keys)
        found: dict[bytes, Any] = {}
        decode = cache.codec.decode
        for key, blob in blobs.items():
            try:
                found[key] = decode(blob, key)
            except DecodeError:  # bytes this process encoded: cannot happen; be safe
                again.append(key)
        if found:
            cache.counters.shard()["recalled"] += len(found)
        return found, again


def _requests(entries: Mapping[bytes, bytes], max_keys: int) -> Iterator[dict[bytes, bytes]]:
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
