"""What a cache holds in the event loop it is used in, and whether it is closed.

A cache may be used from one loop after another (a test's loops, a loop thread made anew
after a fork): its semaphore, tasks and gathered ``get()`` calls belong to one loop, so
they are made afresh when the running loop changes (`Loops.here()`). The cache's
mechanisms (reads, writes, leases, the decorator) reach the loop only through here.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from ..observe.stats import Counters
from .coalesce import Coalescer, CopyOf, Read, SharedComputation

__all__ = ["FINISHED_MAX", "LoopState", "Loops"]

#: Finished computations kept for reads in flight (see `LoopState.finished`): past this
#: many distinct keys finishing during one read, the oldest may be computed again.
FINISHED_MAX = 4096


class LoopState:
    """What a cache holds in one event loop: the bound on reads in flight, the ``get()``
    calls being gathered, computations being shared, its tasks and its writer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_in_flight: int, read: Read,
                 copy_of: CopyOf, counters: Counters) -> None:
        self.loop = loop
        self.in_flight = asyncio.Semaphore(max_in_flight)
        self.tasks: set[asyncio.Task[Any]] = set()
        #: the write-behind task draining the cache's queue, while one is at work
        self.writer: asyncio.Task[None] | None = None
        #: computations in flight, by store key (concurrent callers join them)
        self.computing: dict[bytes, SharedComputation] = {}
        #: computations finished while a read of `AsyncKVCache.compute_once()` was in
        #: flight, by key: (their number in ``finishes``, the computation); cleared when no
        #: such read is left, and bounded by FINISHED_MAX
        self.finished: collections.OrderedDict[bytes, tuple[int, SharedComputation]] = (
            collections.OrderedDict())
        self.finishes = 0
        #: reads in flight that may miss a computation's write (see ``finished``)
        self.readers = 0
        #: the ``get()`` calls of this loop tick, read together
        self.gets = Coalescer(loop, read, copy_of, counters, self.spawn)

    def done(self, store_key: bytes, shared: SharedComputation, task: asyncio.Task[Any]) -> None:
        """A computation ended: no longer joined, but kept for the reads that were in
        flight meanwhile (see `AsyncKVCache.compute_once()`)."""
        if self.computing.get(store_key) is shared:
            del self.computing[store_key]
        self.finishes += 1
        if self.readers and not task.cancelled() and task.exception() is None:
            finished = self.finished
            finished[store_key] = (self.finishes, shared)
            finished.move_to_end(store_key)
            if len(finished) > FINISHED_MAX:
                finished.popitem(last=False)

    def finished_since(self, store_key: bytes, mark: int) -> SharedComputation | None:
        """The computation of ``store_key`` that finished after ``mark``, if one did."""
        entry = self.finished.get(store_key)
        return entry[1] if entry is not None and entry[0] > mark else None

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """A task of this cache's in this loop, kept referenced until it ends."""
        task: asyncio.Task[Any] = self.loop.create_task(coro)  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


class Loops:
    """The `LoopState` of the loop a cache was last used in, and the cache's end.

    ``refuse()`` raises the error a closed cache gives. The read path its ``get()`` calls
    are gathered into is given by `gather_into()`: it is built from the parts that hold
    this object."""

    def __init__(self, max_in_flight: int, counters: Counters,
                 refuse: Callable[[], NoReturn]) -> None:
        self.max_in_flight = max_in_flight
        self._read: Read | None = None
        self._copy_of: CopyOf | None = None
        self._counters = counters
        self._refuse = refuse
        #: the state of the loop last used (None before any); it may be another loop's
        self.last: LoopState | None = None
        #: closed by `AsyncKVCache.aclose()`: nothing asks the store any more
        self.closed = False

    def here(self) -> LoopState:
        """What the cache holds in the running loop (made anew in another loop)."""
        if self.closed:
            self._refuse()
        loop = asyncio.get_running_loop()
        here = self.last
        if here is None or here.loop is not loop:
            assert self._read is not None and self._copy_of is not None, "gather_into()"
            here = self.last = LoopState(loop, self.max_in_flight, self._read,
                                         self._copy_of, self._counters)
        return here

    def gather_into(self, read: Read, copy_of: CopyOf) -> None:
        """Where ``get()`` calls go: ``read(store_keys)`` (the cache's whole read path)
        and ``copy_of`` for a key asked twice. Called once, as the cache is built."""
        self._read, self._copy_of = read, copy_of

    def check_open(self) -> None:
        """Raise the closed cache's error once it is closed."""
        if self.closed:
            self._refuse()
