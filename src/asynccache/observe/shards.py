"""Per-thread shards of a number kept by many threads, summed when read.

Why shards: a cache is used from its event loop thread and from every consumer thread
(DataLoader fetch, thread pools, ``ParallelMapper(method="thread")``). ``counter[k] += 1``
from two threads loses updates, and a lock per increment costs more than a cache hit.
So every thread adds to a shard of its own (found through a ``threading.local``) and
`ThreadShards.total()` sums the shards. A shard is written by exactly one thread;
reading it from another is a C-level copy, atomic under the GIL. Shards of threads that
have ended are folded into one, so a pool that churns threads does not grow the list.
The counters (`asynccache.observe.stats`) and the latency histograms
(`asynccache.observe.histogram`) are both kept this way.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["ThreadShards"]

S = TypeVar("S")


class ThreadShards(Generic[S]):
    """One shard per thread, made by ``new()``; ``fold(into, shard)`` adds a shard to
    another (reading ``shard`` with one C-level copy: its thread may be writing it)."""

    def __init__(self, new: Callable[[], S], fold: Callable[[S, S], None]) -> None:
        self._new = new
        self._fold = fold
        self._local = threading.local()
        self._lock = threading.Lock()
        self._live: list[tuple[weakref.ref[threading.Thread], S]] = []
        self._retired = new()

    def mine(self) -> S:
        """This thread's shard (made on its first use). Only this thread writes it."""
        try:
            return self._local.shard
        except AttributeError:
            shard = self._new()
            self._local.shard = shard
            with self._lock:
                self._live.append((weakref.ref(threading.current_thread()), shard))
            return shard

    def total(self) -> S:
        """The sum over every thread, as a new shard; ended threads' shards are folded
        into one on the way."""
        with self._lock:
            live = []
            for ref, shard in self._live:
                thread = ref()
                if thread is None or not thread.is_alive():
                    self._fold(self._retired, shard)
                else:
                    live.append((ref, shard))
            self._live = live
            total = self._new()
            self._fold(total, self._retired)
            for _ref, shard in live:
                self._fold(total, shard)
        return total
