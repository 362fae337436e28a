"""The one write queue of a cache, and its record of what this process wrote.

Any thread queues encoded values (`WriteQueue.put()`); the cache's event loop takes
them in batches (`WriteQueue.take()`), writes them and reports each batch done
(`WriteQueue.done()`). There is no second queue in front of this one.

Read your writes. Until the store acknowledged a value, the queue holds its bytes:
a read that misses a key this process wrote asks `WriteQueue.own_writes()`, and gets
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
slow store may not answer in time (then the value would be computed again). What the
store lacks is handed to the writer again once it answers (`WriteQueue.unstored()`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

__all__ = ["ACKED_KEEP_SECONDS", "KEEP_DROPPED_BYTES", "RECENT_KEYS", "REWRITE_AFTER",
           "Batch", "WriteQueue"]

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
    def own_writes(self, keys: Iterable[bytes]
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

    def __len__(self) -> int:
        return len(self._queued)
