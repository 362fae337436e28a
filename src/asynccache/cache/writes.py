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
budget keeps the bytes of values acknowledged lately (for ``ACKED_KEEP_SECONDS``): a miss
read before their write landed is answered from memory, not by a second store read that a
slow store may not answer in time (then the value would be computed again).

Recovery. Kept values are what the store lacks: once it answers again (the failure
policy's `FailurePolicy.on_recovered`), `Writer.recover()` writes them again in the
background, a batch at a time through this queue (`WriteQueue.unstored()`); a value read
from the record is queued again too. A kept value whose write landed leaves the record
(after ``ACKED_KEEP_SECONDS``, as any acknowledged value). An acknowledged value that a
read misses ``REWRITE_AFTER`` seconds after its write landed was lost by the store (a
restart, an eviction): it is written again as well.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DecodeError, StoreError, StoreTimeout
from ..store.api import STORE_COUNTS, NodeName, WriteResult
from . import chunks

if TYPE_CHECKING:
    from .core import AsyncKVCache

__all__ = ["ACKED_KEEP_SECONDS", "KEEP_DROPPED_BYTES", "RECENT_KEYS", "REWRITE_AFTER",
           "WRITE_REQUEST_BYTES", "Batch", "WriteQueue", "Writer"]

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

#: A put() this long after the writer last took a batch asks for a writer again (starting
#: one when one is at work costs nothing): the bound on how long an interrupted caller can
#: leave queued writes without a writer.
WAKE_AGAIN_AFTER = 1.0

#: How long the bytes of an acknowledged value stay in the record: long enough for any
#: read-ahead miss sent before the write landed to be answered from memory; then the
#: memory is given back (the key is still read again from the store, see RECENT_KEYS).
ACKED_KEEP_SECONDS = 30.0

#: A read that misses an acknowledged value this long after its write landed was not a
#: read sent before the write: the store lost the value (restarted, evicted, flushed), so
#: the recalled value is written again.
REWRITE_AFTER = 2.0
#: A lone value this large that timed out may be too large for the link (the error says
#: so); a smaller one timing out means a slow or frozen store.
LARGE_ALONE = 256 * 1024


class Batch(NamedTuple):
    """Entries taken for one write request, and the values they complete."""

    entries: dict[bytes, bytes]
    #: value keys whose last entry is in this batch, with the bytes they were queued as
    values: dict[bytes, bytes]


class WriteQueue:
    """Queued entries (value keys, chunk keys) and the values not acknowledged yet."""

    def __init__(self, max_pending: int, recent: int = RECENT_KEYS,
                 keep_bytes: int = KEEP_DROPPED_BYTES, ttl: float | None = None, *,
                 acked_keep: float = ACKED_KEEP_SECONDS,
                 rewrite_after: float = REWRITE_AFTER) -> None:
        self._lock = threading.Lock()
        #: store key -> bytes to write, in queue order (chunks before their manifest)
        self._queued: dict[bytes, bytes] = {}
        #: the entry that completes a value (its own key) -> the value's whole blob
        self._values: dict[bytes, bytes] = {}
        #: value key -> its whole blob, from put() until done() (queued or in flight)
        self._unacked: dict[bytes, bytes] = {}
        self._recent: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._recent_max = recent
        #: the record, two parts sharing ``keep_bytes`` of blobs, oldest first in each:
        #: value key -> (its blob, time.monotonic() when kept). ``_unstored``: values whose
        #: write was dropped or failed (the store lacks them: written again on recovery);
        #: ``_acked``: values acknowledged lately (a read-ahead miss older than the write
        #: is answered from here, not by a second store read that a slow store may not
        #: answer in time), for ``acked_keep`` seconds
        self._unstored: collections.OrderedDict[bytes, tuple[bytes, float]] = (
            collections.OrderedDict())
        self._acked: collections.OrderedDict[bytes, tuple[bytes, float]] = (
            collections.OrderedDict())
        self._kept_bytes = 0
        self._keep_max = keep_bytes
        self._keep_ttl = ttl
        self._acked_keep = acked_keep
        self._rewrite_after = rewrite_after
        #: kept values forgotten since the last `take_forgotten()` (past the budget)
        self._forgotten = 0
        self._max_pending = max_pending
        #: a writer is (or has been asked to be) at work; put() wakes one otherwise
        self._active = False
        #: when the writer last took a batch: a put() long after it wakes a writer again,
        #: whatever ``_active`` says (an interrupt between a put() that asked for a writer
        #: and the caller starting one must not leave every later write waiting)
        self._taken_at = time.monotonic()

    # -- producers: any thread --------------------------------------------------------
    def put(self, values: Mapping[bytes, bytes],
            entries: Mapping[bytes, bytes]) -> tuple[bool, int]:
        """Queue ``entries`` (what to write) for ``values`` (value key -> whole blob).

        Returns ``(wake, dropped)``: whether the caller must start a writer (none is
        at work), and how many queued entries were dropped to stay bounded."""
        if not entries:  # nothing to write: no writer to wake (and none would start)
            return False, 0
        with self._lock:
            queued = self._queued
            for key in entries:
                queued.pop(key, None)  # a rewrite goes to the back of the queue
            queued.update(entries)
            self._values.update(values)
            self._unacked.update(values)
            if self._unstored or self._acked:
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
            wake = not self._active or time.monotonic() - self._taken_at > WAKE_AGAIN_AFTER
            self._active = True
        return wake, dropped

    # -- the writer: the cache's loop ---------------------------------------------------
    def take(self, max_keys: int) -> Batch | None:
        """Up to ``max_keys`` queued entries, oldest first; None (and the writer's turn
        ends) when nothing is queued."""
        with self._lock:
            self._taken_at = time.monotonic()
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
        (self._acked if written else self._unstored)[key] = (blob, time.monotonic())
        self._kept_bytes += len(blob)
        self._trim()

    def _trim(self) -> None:  # locked
        """Within the budget: acknowledged values go first (the store has them), then the
        oldest values the store lacks (counted as forgotten); acknowledged values past
        ``acked_keep`` leave the record whatever the budget."""
        acked = self._acked
        if acked:
            too_old = time.monotonic() - self._acked_keep
            while acked and (self._kept_bytes > self._keep_max
                             or next(iter(acked.values()))[1] < too_old):
                _key, (old, _at) = acked.popitem(last=False)
                self._kept_bytes -= len(old)
        while self._kept_bytes > self._keep_max and self._unstored:
            _key, (old, _at) = self._unstored.popitem(last=False)
            self._kept_bytes -= len(old)
            self._forgotten += 1

    def _unkeep(self, key: bytes) -> None:  # locked
        held = self._unstored.pop(key, None) or self._acked.pop(key, None)
        if held is not None:
            self._kept_bytes -= len(held[0])

    def _expired(self, at: float, now: float) -> bool:
        return self._keep_ttl is not None and now - at > self._keep_ttl

    def take_forgotten(self) -> int:
        """Kept values dropped past the budget since the last call (for the counter)."""
        with self._lock:
            n, self._forgotten = self._forgotten, 0
        return n

    @property
    def kept_bytes(self) -> int:
        """Bytes of the record: values the store lacks and values acknowledged lately."""
        if self._acked:
            with self._lock:
                self._trim()
        return self._kept_bytes

    @property
    def unstored_values(self) -> int:
        """Values kept because their write was dropped or failed (the store lacks them)."""
        return len(self._unstored)

    def unstored(self, max_values: int, max_bytes: int) -> dict[bytes, bytes]:
        """The oldest kept values the store lacks, up to ``max_values`` and about
        ``max_bytes`` (at least one): to write again, through `put()` (which takes them out
        of the record until their write is answered). Values past the ttl are forgotten
        (the store would have let them expire by now)."""
        found: dict[bytes, bytes] = {}
        size = 0
        with self._lock:
            now = time.monotonic()
            for key, (blob, at) in list(self._unstored.items()):
                if self._expired(at, now):
                    self._unkeep(key)
                    continue
                if key in self._unacked:
                    continue  # queued again meanwhile: that write is the newer one
                if found and (len(found) >= max_values or size + len(blob) > max_bytes):
                    break
                found[key] = blob
                size += len(blob)
        return found

    # -- readers: any thread, on a miss -------------------------------------------------
    def recall(self, keys: Iterable[bytes]
               ) -> tuple[dict[bytes, bytes], list[bytes], dict[bytes, bytes]]:
        """For keys that missed: the blobs of those this process wrote and the store has
        not acknowledged, the keys acknowledged lately (read them again), and the blobs
        of those the store lacks (kept: the caller writes them again) -- never took, or
        acknowledged over ``rewrite_after`` seconds ago and missing now (lost since)."""
        found: dict[bytes, bytes] = {}
        again: list[bytes] = []
        kept: dict[bytes, bytes] = {}
        with self._lock:
            if not (self._unacked or self._recent or self._unstored or self._acked):
                return found, again, kept
            now = time.monotonic()
            for key in keys:
                blob = self._unacked.get(key)
                if blob is not None:
                    found[key] = blob
                    continue
                held = self._unstored.get(key)
                if held is not None:
                    if not self._expired(held[1], now):
                        kept[key] = held[0]
                        continue
                    self._unkeep(key)  # it would have expired in the store by now
                held = self._acked.get(key)
                if held is not None:
                    if self._expired(held[1], now) or now - held[1] > self._acked_keep:
                        self._unkeep(key)
                    else:
                        (kept if now - held[1] > self._rewrite_after else found)[key] = held[0]
                        continue
                if key in self._recent:
                    again.append(key)
        return found, again, kept

    def discard(self, keys: Iterable[bytes]) -> None:
        """Forget ``keys`` (an invalidation): their queued writes are not made, and no miss
        recalls them or reads them again for this process's sake."""
        with self._lock:
            if not (self._queued or self._unacked or self._recent or self._unstored
                    or self._acked):
                return
            for key in keys:
                self._queued.pop(key, None)
                self._values.pop(key, None)
                self._unacked.pop(key, None)
                self._recent.pop(key, None)
                self._unkeep(key)

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
        #: the store answered again after failing: how many of the record's values the
        #: store lacks the writer still writes again once its queue is empty (a bound: a
        #: value the store keeps refusing is not tried for ever; see `recover()`)
        self.recovering = 0
        #: the timer that tries the record's values again once a back-off ends
        self._probe: asyncio.TimerHandle | None = None
        cache.policy.on_recovered = self.recover

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
            size = len(next(iter(part.values()))) if len(part) == 1 else 0
            if isinstance(exc, StoreTimeout) and size >= LARGE_ALONE:
                # a value that alone may outlast the timeout on a slow link; a small one
                # timing out says the store is slow or frozen (the message already does)
                exc = result.failures[node] = StoreTimeout(  # logged, and raised
                    f"{exc} — this request was one value of {_size(size)}: at this link's "
                    f"speed it may need more than timeout={cache.client.timeout:g}s; raise "
                    "timeout= in connect(), or it is never cached")
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
        """Start this loop's writer if entries are queued (or the record is to be written
        again) and none is at work (loop)."""
        cache = self.cache
        here = cache._loop()
        if (here.writer is None or here.writer.done()) and (
                len(cache.writes) or (self.recovering and cache.writes.unstored_values)):
            here.writer = here.spawn(self._drain())

    def recover(self) -> None:
        """A store node answered after failing: write the values this process keeps
        because the store lacks them, in the background (any thread: the policy calls it
        from whichever thread saw the answer)."""
        cache = self.cache
        if cache._closed:  # done with the store: a write now would reopen its connections
            return
        self.recovering = cache.writes.unstored_values
        if not self.recovering:
            return
        here = cache._loop_state
        if here is None or here.loop.is_closed():
            return  # no loop yet: the next write starts the writer, which goes on with these
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is here.loop:
            self.start()
        else:
            here.loop.call_soon_threadsafe(self.start)

    async def _drain(self) -> None:
        cache = self.cache
        writes, max_keys = cache.writes, cache.client.max_batch * 4
        while True:
            batch = writes.take(max_keys)
            if batch is None:
                if not self._rewrite_next(max_keys):
                    return
                continue
            written = False
            try:
                written = await self.write_entries(batch.entries, cache.ttl)
            except StoreError:
                pass  # raise mode: counted by the policy; nobody waits on write-behind
            finally:
                writes.done(batch, written)
                if not written:
                    if cache.policy.down():
                        self.recovering = 0  # failing again: the next recovery goes on
                        self._probe_later()
                    self.count_forgotten()

    def _probe_later(self) -> None:
        """Once the back-off ends, try the values the store lacks again (loop): the
        probe that finds a store back even when no read asks it (every read a near hit,
        a process that only writes). Its success is a recovery (`recover()`); its
        failure backs the node off longer, and is probed again after that."""
        if self._probe is not None or not self.cache.writes.unstored_values:
            return
        delay = self.cache.policy.retry_in()
        if delay is None:
            return
        loop = asyncio.get_running_loop()
        self._probe = loop.call_later(delay + 0.01, _probe_weakly, weakref.ref(self))

    def probe(self) -> None:
        """The back-off ended: write the record's values again (loop)."""
        self._probe = None
        self.recover()  # (nothing for a closed cache)

    def _rewrite_next(self, max_keys: int) -> bool:
        """Queue the next batch of kept values the store lacks, while recovering and no
        node is backing off; False when there is none (the writer's turn ends)."""
        cache = self.cache
        if self.recovering <= 0:
            return False
        if cache.policy.down():  # some node still backing off: try when it ends
            self.recovering = 0
            self._probe_later()
            return False
        blobs = cache.writes.unstored(min(max_keys, self.recovering), WRITE_REQUEST_BYTES)
        if not blobs:
            self.recovering = 0
            return False
        self.recovering -= len(blobs)
        cache.counters.shard()["rewritten"] += len(blobs)
        self.write_later(blobs)
        return True

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
        only misses ask. Counting the reads is the caller's (it knows what they were)."""
        cache = self.cache
        blobs, again, kept = cache.writes.recall(store_keys)
        found: dict[bytes, Any] = {}
        decode = cache.codec.decode
        for key, blob in itertools.chain(blobs.items(), kept.items()):
            try:
                found[key] = decode(blob, key)
            except DecodeError:  # bytes this process encoded: cannot happen; be safe
                again.append(key)
        return found, again, kept


def _probe_weakly(ref: weakref.ref[Writer]) -> None:
    # a weak reference: a pending probe must not keep a cache nobody uses alive
    writer = ref()
    if writer is not None:
        writer.probe()


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


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
