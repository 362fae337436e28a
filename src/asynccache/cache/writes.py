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
(counted as ``writes_dropped``). A value whose write was dropped or failed is not in the
store, yet this process has returned it: it is kept (`WriteQueue.keep()`, up to
``KEEP_DROPPED_BYTES`` of blobs, no longer than the cache's ttl), so that a read of it
here returns that same value, not a new computation (which a source with randomness, an
augmentation, would make different). Past the budget the oldest kept values are
forgotten (counted as ``writes_forgotten``): a later read computes them again. The same
budget keeps the bytes of values acknowledged lately: a miss read before their write
landed is answered from memory, not by a second store read that a slow store may not
answer in time (then the value would be computed again).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DecodeError, StoreError, StoreTimeout
from ..store.api import STORE_COUNTS, NodeName, WriteResult
from . import chunks

if TYPE_CHECKING:
    from .core import AsyncKVCache

__all__ = ["KEEP_DROPPED_BYTES", "RECENT_KEYS", "WRITE_REQUEST_BYTES", "Batch", "WriteQueue",
           "Writer"]

#: Bytes per write request: a request must fit in ``timeout`` (a 50 MB batch is not one
#: 1-second request), and reads queue behind less.
WRITE_REQUEST_BYTES = 8 * 1024 * 1024

#: Keys acknowledged lately that a miss reads again instead of computing. A read-ahead
#: miss waits in a prefetcher's buffer for at most a window (``4 * prefetch`` items per
#: node and thread), so a write acknowledged after it was read is among the last few
#: thousand; this bound keeps that true for windows far larger than the default.
RECENT_KEYS = 1 << 16

#: Bytes of encoded values kept per cache for read-your-writes after their write was
#: dropped or failed (a slow or dead store): what this process returned, it reads again.
KEEP_DROPPED_BYTES = 64 * 1024 * 1024


class Batch(NamedTuple):
    """Entries taken for one write request, and the values they complete."""

    entries: dict[bytes, bytes]
    #: value keys whose last entry is in this batch, with the bytes they were queued as
    values: dict[bytes, bytes]


class WriteQueue:
    """Queued entries (value keys, chunk keys) and the values not acknowledged yet."""

    def __init__(self, max_pending: int, recent: int = RECENT_KEYS,
                 keep_bytes: int = KEEP_DROPPED_BYTES, ttl: float | None = None) -> None:
        self._lock = threading.Lock()
        #: store key -> bytes to write, in queue order (chunks before their manifest)
        self._queued: dict[bytes, bytes] = {}
        #: the entry that completes a value (its own key) -> the value's whole blob
        self._values: dict[bytes, bytes] = {}
        #: value key -> its whole blob, from put() until done() (queued or in flight)
        self._unacked: dict[bytes, bytes] = {}
        self._recent: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._recent_max = recent
        #: value key -> (its blob, time.monotonic() when kept, whether the store took it):
        #: values whose write was dropped or failed, and values acknowledged lately (a
        #: read-ahead miss older than the write is answered from here, not by a second
        #: store read that a slow store may not answer in time), oldest first, at most
        #: ``keep_bytes`` of blobs
        self._kept: collections.OrderedDict[bytes, tuple[bytes, float, bool]] = (
            collections.OrderedDict())
        self._kept_bytes = 0
        self._keep_max = keep_bytes
        self._keep_ttl = ttl
        #: kept values forgotten since the last `take_forgotten()` (past the budget)
        self._forgotten = 0
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
            if self._kept:
                for key in values:  # written again: the new value is the one to recall
                    self._unkeep(key)
            dropped = 0
            overflow = len(queued) - self._max_pending
            if overflow > 0:
                for key in list(queued)[:overflow]:
                    del queued[key]
                    blob = self._values.pop(key, None)
                    if blob is not None and self._unacked.get(key) is blob:
                        del self._unacked[key]
                        self._keep(key, blob, False)  # never stored: recalled from here
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

    def done(self, batch: Batch, written: bool = True) -> None:
        """The store answered for ``batch``: its values are no longer this queue's to
        hand out; their keys are remembered as acknowledged. Not ``written`` (some of
        it failed): its values are kept (`keep()`), the store may not have them."""
        recent, unacked = self._recent, self._unacked
        with self._lock:
            for key, blob in batch.values.items():
                if unacked.get(key) is blob:  # not queued again since
                    del unacked[key]
                    self._keep(key, blob, written)
                recent[key] = None
                recent.move_to_end(key)
            while len(recent) > self._recent_max:
                recent.popitem(last=False)

    # -- values the store did not take ---------------------------------------------------
    def keep(self, values: Mapping[bytes, bytes]) -> None:
        """Keep values whose write was dropped or failed outside this queue (a write
        made now that timed out): recalled as if queued."""
        with self._lock:
            for key, blob in values.items():
                self._keep(key, blob, False)

    def _keep(self, key: bytes, blob: bytes, written: bool) -> None:  # locked
        self._unkeep(key)
        if len(blob) > self._keep_max:
            self._forgotten += not written
            return
        self._kept[key] = (blob, time.monotonic(), written)
        self._kept_bytes += len(blob)
        while self._kept_bytes > self._keep_max:
            _key, (old, _at, was_written) = self._kept.popitem(last=False)
            self._kept_bytes -= len(old)
            self._forgotten += not was_written  # a written one is in the store

    def _unkeep(self, key: bytes) -> None:  # locked
        held = self._kept.pop(key, None)
        if held is not None:
            self._kept_bytes -= len(held[0])

    def _kept_blob(self, key: bytes) -> tuple[bytes, bool] | None:  # locked
        held = self._kept.get(key)
        if held is None:
            return None
        blob, at, written = held
        if self._keep_ttl is not None and time.monotonic() - at > self._keep_ttl:
            self._unkeep(key)  # it would have expired in the store by now
            return None
        return blob, written

    def take_forgotten(self) -> int:
        """Kept values dropped past the budget since the last call (for the counter)."""
        with self._lock:
            n, self._forgotten = self._forgotten, 0
        return n

    @property
    def kept_bytes(self) -> int:
        """Bytes of values kept because their write was dropped or failed."""
        return self._kept_bytes

    # -- readers: any thread, on a miss -------------------------------------------------
    def recall(self, keys: Iterable[bytes]
               ) -> tuple[dict[bytes, bytes], list[bytes], dict[bytes, bytes]]:
        """For keys that missed: the blobs of those this process wrote and the store has
        not acknowledged, the keys acknowledged lately (read them again), and the blobs
        of those the store never took (kept: the caller writes them again, the store
        still lacks them)."""
        found: dict[bytes, bytes] = {}
        again: list[bytes] = []
        kept: dict[bytes, bytes] = {}
        with self._lock:
            if not self._unacked and not self._recent and not self._kept:
                return found, again, kept
            for key in keys:
                blob = self._unacked.get(key)
                if blob is not None:
                    found[key] = blob
                    continue
                if self._kept:
                    held = self._kept_blob(key)
                    if held is not None:
                        (found if held[1] else kept)[key] = held[0]
                        continue
                if key in self._recent:
                    again.append(key)
        return found, again, kept

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
            self.count_forgotten()
        return wake

    def count_forgotten(self) -> None:
        """Count kept values forgotten past the budget (``writes_forgotten``)."""
        forgotten = self.cache.writes.take_forgotten()
        if forgotten:
            self.cache.counters.shard()["writes_forgotten"] += forgotten

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
            written = False
            try:
                written = await self.write_entries(batch.entries, cache.ttl)
            except StoreError:
                pass  # raise mode: counted by the policy; nobody waits on write-behind
            finally:
                writes.done(batch, written)
                if not written:
                    self.count_forgotten()

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

    def recall(self, store_keys: Sequence[bytes]
               ) -> tuple[dict[bytes, Any], list[bytes], dict[bytes, bytes]]:
        """For keys that missed: values this process wrote and the store has not
        acknowledged or never took (decoded afresh: an object of their own), the keys
        acknowledged lately, which the store now holds (read them again rather than
        compute them), and the blobs the store never took: the caller writes them again
        (`write_later()`), so that a store back from an outage gets them. Any thread;
        only misses ask."""
        cache = self.cache
        blobs, again, kept = cache.writes.recall(store_keys)
        found: dict[bytes, Any] = {}
        decode = cache.codec.decode
        for key, blob in itertools.chain(blobs.items(), kept.items()):
            try:
                found[key] = decode(blob, key)
            except DecodeError:  # bytes this process encoded: cannot happen; be safe
                again.append(key)
        if found:
            cache.counters.shard()["recalled"] += len(found)
        return found, again, kept


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
