"""The read-ahead engine: one consumer thread's reads in flight and values ready, their
deliveries and waits, the window sized by what replies carry, and the counters, for
both users -- the pipe's `Prefetcher` (which adds a plan: what comes next, followed
across epochs) and the torchdata node (whose plan is its source's order).

Why it is built this way: docs/design.md, "The prefetcher".
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from typing import Any

from .._sentinel import Sentinel
from ..cache.port import MISSING, NOT_READ, Failed
from ..errors import CacheError, StoreTimeout
from .readers import Reader, Ticket
from .window import BOUNDED_REQUEST_BYTES, WindowSizer

__all__ = ["NOTHING", "ReadAhead", "served"]


class NOTHING(Sentinel, metaclass=Sentinel):
    """Not in the ready buffer."""


def served(value: Any) -> bool:
    """A value read ahead that serves the read: not a miss, not a failure."""
    return value is not MISSING and type(value) is not Failed


def _drain(iterator: Any) -> None:
    collections.deque(iterator, maxlen=0)


class ReadAhead:
    """Reads of ``key_of(index)`` for one consumer thread over ``reader``: requests in
    flight (``inflight``: index -> its request), values arrived (``ready``), a value
    taken (`_await`, waiting when it is still on the wire), a request read now
    (`_read_direct`), and a call stopped by an exception between two steps repaired by
    the next (`_guarded`, `repair`). An index is anything hashable: the pipe's indices,
    the node's entries. ``strict`` is the cache's raise mode.
    """

    def __init__(self, reader: Reader, key_of: Callable[[Any], bytes], strict: bool,
                 sizer: WindowSizer) -> None:
        self.reader = reader
        self.key_of = key_of
        self.strict = strict
        self.sizer = sizer
        #: the sizer's, copied here after each change: read on every item
        self.window, self.batch = sizer.window, sizer.batch
        #: requests carry enough bytes that a wait should do no more than it needs
        #: (``reader.advance``); below, taking everything that arrived is cheaper
        self.bounded = False
        self._resized()
        self.ready: dict[Any, Any] = {}
        self.inflight: dict[Any, Ticket] = {}
        #: a request made before the last change of plan (or repair) is never delivered
        self.generation = 0
        #: the epoch clock's turns (the pipe's; requests carry the one they were sent in)
        self.epoch = 0
        #: told of each request delivered into ``ready`` (the node starts the computes
        #: of its misses there)
        self.delivered: Callable[[Ticket], None] | None = None
        self.hits = self.misses = self.prefetch_hits = 0
        self.stalls = self.stall_us = self.direct_reads = self.wasted = self.stall_timeouts = 0
        #: A call into this engine is under way, or one was stopped by an exception
        #: between two of its steps (an interrupt, a signal handler's exception, a raise
        #: mode error): the next call repairs the state first (`repair()`).
        self.broken = False
        self.interrupted = 0  # repairs made (the stats' ``interrupted_reads``)

    # -- interrupts -------------------------------------------------------------------------
    def _guarded(self, step: Callable[..., Any], *args: Any) -> Any:
        """Run one consumer call's ``step``: ``broken`` while it runs, so that an
        exception at any bytecode inside it (a signal handler's, ``KeyboardInterrupt``)
        leaves a state the next call recognises. The exception itself goes to the
        caller unchanged."""
        if self.broken:
            self.repair()
        self.broken = True
        result = step(*args)
        self.broken = False
        return result

    def repair(self) -> None:
        """Start afresh after a call that did not finish: every read in flight is
        forgotten (its replies are dropped with the consumer's connections, a loop-side
        one is ignored when it completes). Values already in the buffer are kept: each is
        whole. Idempotent, so an interrupt inside it only means the next call repairs
        again."""
        self.generation += 1  # a ticket sent before is never delivered
        for ticket in self.inflight.values():
            ticket.abandoned = True
        self.inflight.clear()
        self.reader.reset()
        self._repaired()
        self.interrupted += 1
        self.broken = False

    def _repaired(self) -> None:
        """What a user of the engine resets after `repair()` (the pipe: its plan's
        requested positions)."""

    def _taken(self) -> int:
        """Items the consumer has taken so far (the window follows its rate)."""
        return self.hits + self.misses

    def forget(self) -> None:
        """Drop every request in flight (abandoned: a late reply is ignored) and every
        value ready: the consumer starts again (the node's reset)."""
        self.generation += 1
        for ticket in self.inflight.values():
            ticket.abandoned = True
        self.wasted += len(self.ready)
        self.inflight.clear()
        self.ready.clear()

    # -- requests ---------------------------------------------------------------------------
    def _submit(self, indices: list[Any], direct: bool = False) -> Ticket:
        key_of = self.key_of
        try:
            keys = [key_of(i) for i in indices]
        except CacheError:  # an index the key scheme refuses: leave it to the direct read
            if direct:
                raise
            pairs = []
            for i in indices:
                try:
                    pairs.append((i, key_of(i)))
                except CacheError:
                    continue
            indices, keys = [i for i, _ in pairs], [k for _, k in pairs]
        ticket = Ticket(indices, keys, direct=direct, generation=self.generation)
        ticket.epoch = self.epoch
        if not direct:
            self.inflight.update(dict.fromkeys(indices, ticket))
        self.reader.submit(ticket)
        return ticket

    def _deliver(self, tickets: list[Ticket]) -> None:
        """Move completed read-ahead into the ready buffer; drop what was not read."""
        generation, ready, inflight = self.generation, self.ready, self.inflight
        now = time.perf_counter() if tickets else 0.0
        for ticket in tickets:
            if self.sizer.learn(ticket) | (not ticket.direct and self.sizer.timed(
                    now, self._taken(), self.stall_us, len(ready))):
                self._resized()
            if ticket.direct or ticket.abandoned or ticket.generation != generation:
                continue
            if ticket.epoch != self.epoch:  # sent before the clock turned: hits only
                self._deliver_hits(ticket)
                continue
            _drain(map(inflight.pop, ticket.indices, itertools.repeat(None)))
            if ticket.partial:
                ready.update((i, v) for i, v in zip(ticket.indices, ticket.values)
                             if v is not NOT_READ)
            else:
                ready.update(zip(ticket.indices, ticket.values))
            if self.delivered is not None:
                self.delivered(ticket)

    def _deliver_hits(self, ticket: Ticket) -> None:
        ready, inflight = self.ready, self.inflight
        for index, value in zip(ticket.indices, ticket.values):
            if inflight.get(index) is not ticket:
                continue
            del inflight[index]
            if value is MISSING or value is NOT_READ or type(value) is Failed:
                self.wasted += 1  # read again when it comes (directly)
            else:
                ready[index] = value

    def _resized(self) -> None:
        sizer = self.sizer
        self.window, self.batch = sizer.window, sizer.batch
        self.bounded = sizer.item_bytes * sizer.batch >= BOUNDED_REQUEST_BYTES

    @property
    def item_bytes(self) -> float:
        return self.sizer.item_bytes

    @property
    def value_bytes(self) -> float:
        return self.sizer.value_bytes

    def _abandon(self, ticket: Ticket) -> None:
        """The ticket missed its deadline: forget it (a late result is ignored)."""
        ticket.abandoned = True
        self.stall_timeouts += 1
        inflight = self.inflight
        for index in ticket.indices:
            if inflight.get(index) is ticket:
                del inflight[index]
        if ticket.error is None:
            ticket.error = StoreTimeout("a read did not complete within its deadline")

    def _await(self, index: Any) -> Any:
        """The value of ``index`` if it is in flight (waiting for it); ``NOTHING`` if it
        was never requested or its read failed (fallback; raise mode raises)."""
        ticket = self.inflight.get(index)
        if ticket is None:  # never requested, or delivered by an earlier wait
            value = self.ready.pop(index, NOTHING)
            if value is not NOTHING and served(value):
                self.prefetch_hits += 1
            return value
        reader = self.reader
        if not ticket.done:
            self._deliver(reader.advance(ticket) if self.bounded else reader.poll())
        stalled = not ticket.done
        if stalled:  # not here yet: a real stall
            self.stalls += 1
            started = time.perf_counter()
            if not reader.wait(ticket):
                self._abandon(ticket)
            self.stall_us += int((time.perf_counter() - started) * 1e6)
        self._deliver(reader.advance(ticket) if self.bounded else reader.poll())
        value = self.ready.pop(index, NOTHING)
        if value is NOTHING:
            if self.strict and ticket.error is not None:
                raise ticket.error
        elif not stalled and served(value):
            self.prefetch_hits += 1  # it had arrived: only its parsing was deferred
        return value

    def _read_direct(self, indices: list[Any]) -> list[Any]:
        """Values for indices nobody requested yet (or whose read failed): one request,
        waited for. ``MISSING`` where absent or not readable (raise mode raises)."""
        return self._end_direct(self._start_direct(indices))

    def _start_direct(self, indices: list[Any]) -> Ticket:
        """Send the request of `_read_direct()` (read-ahead sent after it queues
        behind it, not in front: one round trip for both)."""
        self.direct_reads += len(indices)
        return self._submit(indices, direct=True)

    def _end_direct(self, ticket: Ticket) -> list[Any]:
        indices = ticket.indices
        if not ticket.done and not self.reader.wait(ticket):
            self._abandon(ticket)
        self._deliver(self.reader.poll())  # read-ahead that completed meanwhile
        if ticket.abandoned:
            if self.strict:
                raise ticket.error  # type: ignore[misc]
            return [MISSING] * len(indices)
        values = ticket.values
        if ticket.partial:
            if self.strict and ticket.error is not None:
                raise ticket.error
            values = [MISSING if v is NOT_READ else v for v in values]
        return values

    def _result(self, value: Any) -> Any:
        if value is MISSING:
            self.misses += 1
        elif type(value) is Failed:
            raise value.error
        else:
            self.hits += 1
        return value

    def close(self) -> None:
        """Release the reader (in-flight read-ahead is dropped)."""
        self.reader.close()
        self.inflight.clear()
        self.ready.clear()
