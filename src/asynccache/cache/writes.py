"""The one write-behind queue of a cache, and the values it has not written yet.

Any thread queues encoded values (:meth:`WriteQueue.put`); the cache's event loop takes
them in batches (:meth:`WriteQueue.take`), writes them and reports each batch done
(:meth:`WriteQueue.done`). There is no second queue in front of this one.

Read your writes. Until the store acknowledged a value, the queue holds its bytes:
a read that misses a key this process wrote asks :meth:`WriteQueue.recall`, and gets
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

import collections
import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple

__all__ = ["RECENT_KEYS", "Batch", "WriteQueue"]

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
