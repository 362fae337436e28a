"""The prefetcher: keeps the next ``prefetch`` planned indices in flight or ready.

Why it is built this way: docs/design.md, "The prefetcher".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from ..cache.port import MISSING, Failed
from ..observe.catalog import PREFETCH_COUNTERS
from .engine import NOTHING, ReadAhead, served
from .readers import Reader
from .window import DEFAULT_READAHEAD_BYTES, Budget, WindowSizer

__all__ = ["Prefetcher"]

#: Reads in a row that a followed order's plan did not foresee (not the plan's next index)
#: after which read-ahead stops guessing: a sampler the pipe cannot follow (its own RNG)
#: is found within a batch or two; a new epoch's first read that finds its epoch (a
#: skipped or resumed one) is one read, and the plan is followed from there.
STOP_AFTER = 32
#: Reads in a row on the plan (in its order) after which stopped read-ahead resumes.
RESUME_AFTER = 16

def _repeated(plan: Sequence[Any]) -> set[Any]:
    """The indices ``plan`` holds more than once (none in a range)."""
    if isinstance(plan, range):
        return set()
    seen: set[Any] = set()
    return {i for i in plan if i in seen or seen.add(i)}  # type: ignore[func-returns-value]


class Prefetcher(ReadAhead):
    """Read-ahead along a plan for one consumer thread over ``reader``; keys from
    ``key_of(index)`` (the engine: `ReadAhead`).

    ``length`` (None for datasets keyed by something else than 0..n-1) bounds
    sequential read-ahead. ``strict`` is the cache's raise mode.
    """

    def __init__(self, reader: Reader, key_of: Callable[[Any], bytes],
                 length: int | None, prefetch: int, strict: bool,
                 budget: int | Budget = DEFAULT_READAHEAD_BYTES) -> None:
        self.length = length
        self.prefetch = max(0, prefetch)
        super().__init__(reader, key_of, strict, WindowSizer(self.prefetch, budget))
        #: indices the plan holds more than once (a sampler with replacement), and how
        #: many of their planned positions were passed over by a request because a read of
        #: the same index was already ready or in flight: each is requested again when its
        #: value is taken (`_repay()`), so that a repeat is read ahead, not read directly
        self.repeats: set[Any] = set()
        self.owed: dict[Any, int] = {}
        self.again: list[Any] = []
        self.plan: Sequence[Any] = ()
        self.plan_len = 0
        self.pos = 0          # plan position of the next expected index
        self.requested = 0    # plan positions below this have been requested
        #: The next epoch of an order: ``replan(None)`` guesses it (asked when a plan is used
        #: up, so that its first batch is read ahead across the epoch's boundary);
        #: ``replan(first)`` finds the one whose first read is ``first``.
        self.replan: Callable[[Any], list[Any]] | None = None
        #: the plan is a guess that its first read has not confirmed yet; ``tentative``:
        #: one of the next epoch, read ahead a batch only until then
        self.guessed = self.tentative = False
        self.last_index: Any = None
        #: set (by any thread) when the pipe's order changed: re-planned at the next read
        #: that is not a plain in-order hit, by ``follow_order(self)``
        self.stale_order = False
        self.follow_order: Callable[[], tuple[Sequence[Any], Callable[[Any], list[Any]]]
                                    | None] | None = None
        #: in-order reads served from the buffer: the one counter the fast path touches
        #: (``fast_specials`` of them were misses or failures, counted on the slow path)
        self.fast_reads = self.fast_specials = 0
        #: The epoch clock of a followed order (see `follow()`): every other read, and
        #: the read count at which the current epoch began, in reads of ``epoch_len``.
        self.slow_reads = 0
        self.epoch_len = 0  # reads per epoch of the order followed; 0: no order
        self.epoch_start = 0
        #: An order followed whose reads keep landing off the plan (a sampler with an RNG
        #: of its own): read-ahead stops (``stopped``) after STOP_AFTER such reads in a
        #: row, and resumes after RESUME_AFTER reads in a row that the plan foresaw.
        self.off_plan = self.on_plan = 0
        self.stopped = False
        self.times_stopped = 0  # the stats' ``readahead_stopped``
        #: while stopped: where each index is in the plan, so that a read lands the plan
        #: there and the reads after it can show the plan right again
        self.where: dict[Any, int] | None = None
        #: told (once per stop) when read-ahead stops: the pipe warns once per job
        self.on_stop: Callable[[], None] | None = None

    @staticmethod
    def zero_counts() -> dict[str, int]:
        return dict.fromkeys(PREFETCH_COUNTERS, 0)

    @property
    def counts(self) -> dict[str, int]:
        fast = self.fast_reads
        plain = fast - self.fast_specials  # the fast path's misses and failures are not
        return {"hits": self.hits + plain, "misses": self.misses,
                "prefetch_hits": self.prefetch_hits + plain, "stalls": self.stalls,
                "stall_us": self.stall_us, "direct_reads": self.direct_reads,
                "prefetch_wasted": self.wasted, "stall_timeouts": self.stall_timeouts,
                "interrupted_reads": self.interrupted, "readahead_stopped": self.times_stopped}

    def _taken(self) -> int:
        return self.fast_reads + self.slow_reads

    def _repaired(self) -> None:
        """After `repair()`: the plan is requested again from where the consumer is."""
        self.requested = min(self.requested, self.pos)
        self._rewound()
        self.again.clear()

    # -- plan -----------------------------------------------------------------------------
    def follow(self, plan: Sequence[Any], replan: Callable[[Any], list[Any]]) -> None:
        """See `_follow`."""
        self._guarded(self._follow, plan, replan)

    def _follow(self, plan: Sequence[Any], replan: Callable[[Any], list[Any]]) -> None:
        """Follow an order: ``plan`` is this consumer's epoch of it, ``replan`` the next
        (see `replan`); a plan whose first read is not its first index is replaced
        by ``replan(that index)``.

        Starts the epoch clock: every ``len(plan)`` reads, whatever they read, an epoch is
        over. The plan is a guess (a worker's copy of an unseeded sampler draws another
        permutation than the DataLoader), the count is not: a DataLoader hands each worker
        the same number of items every epoch. At each turn of the clock the misses read
        ahead are forgotten, because another process may have computed and written them
        since. A value written in one epoch is thus read in the next even when the plan
        is wrong, instead of a stale miss, read ahead before it was written, recomputing it.
        """
        self.epoch_len = len(plan)
        self.epoch_start = self.fast_reads + self.slow_reads
        self.stopped, self.off_plan, self.on_plan = False, 0, 0  # a new order: followed again
        self._set_plan(plan, replan, guessed=True)

    def _epoch_turned(self, reads: int) -> bool:
        """After ``reads`` reads: has an epoch of the followed order ended since the last
        turn? If so, move the clock on and forget the misses read ahead before it: those
        in the buffer now, and those of requests still in flight when they arrive (their
        hits are kept: a value is never stale). The plan is requested again from the
        current position, so a forgotten miss is read again ahead, not one by one."""
        length = self.epoch_len
        if not length or reads - self.epoch_start < length:
            return False
        self.epoch_start += (reads - self.epoch_start) // length * length
        self.epoch += 1
        self.requested = min(self.requested, self.pos)
        self._rewound()
        ready = self.ready
        stale = [i for i, v in ready.items() if v is MISSING or type(v) is Failed]
        for index in stale:
            del ready[index]
        self.wasted += len(stale)
        return True

    def epoch_ends(self) -> bool:
        """The reads so far complete an epoch of the followed order (the last batch of a
        worker's share, even when the plan guessed the wrong indices)."""
        length = self.epoch_len
        return bool(length) and self.fast_reads + self.slow_reads - self.epoch_start >= length

    def set_plan(self, plan: Sequence[Any], replan: Callable[[Any], list[Any]] | None = None,
                 guessed: bool = False, tentative: bool = False) -> None:
        """See `_set_plan` (a consumer call: guarded against interrupts)."""
        self._guarded(self._set_plan, plan, replan, guessed, tentative)

    def _set_plan(self, plan: Sequence[Any], replan: Callable[[Any], list[Any]] | None = None,
                  guessed: bool = False, tentative: bool = False) -> None:
        """Follow ``plan`` from its start; when it is used up, follow ``replan``.

        A ``guessed`` plan is replaced by ``replan(index)`` when its first read is another
        index. A ``tentative`` one (the next epoch of an order, planned as the current
        one ends) is read ahead one batch only until a read confirms it: a guess that is
        wrong, or an epoch that never comes (a worker that exits), wastes one request,
        not a window.
        """
        self.generation += 1
        self.wasted += len(self.ready)
        self.ready.clear()
        self.inflight.clear()
        self.plan, self.plan_len, self.pos, self.requested = plan, len(plan), 0, 0
        self.repeats = _repeated(plan)
        self.where = None
        self.owed.clear()
        self.again.clear()
        self.replan = replan
        self.guessed, self.tentative = guessed or tentative, tentative
        self._top_up()

    def _next_epoch(self, first: Any = None) -> bool:
        """Replace a used-up (or disproved) plan by the order's next epoch; False when the
        order ran dry (it is not followed any more)."""
        replan = self.replan
        assert replan is not None
        plan = replan(first)
        if not plan:
            self.replan = None
            return False
        if first is not None and self.pos == 0 and plan == self.plan:
            self.guessed = False  # no better plan than the guess: keep what it read ahead
            return False
        self._set_plan(plan, replan, tentative=first is None)
        return True

    def _top_up(self) -> None:
        """Request planned indices, a batch at a time, while the window has room; when the
        plan is used up, plan the order's next epoch (its first batch is read ahead)."""
        window, batch, plan = self.window, self.batch, self.plan
        if window == 0 or self.stopped:
            return
        if self.pos >= self.plan_len and self.replan is not None and self.plan_len:
            self._next_epoch()
            return
        ahead = batch if self.tentative and not self.pos else window
        limit = min(self.plan_len, self.pos + ahead)
        start = max(self.requested, self.pos)
        ready, inflight, repeats = self.ready, self.inflight, self.repeats
        if self.again:  # repeats whose earlier read was taken: their own read now
            again, self.again = self.again, []
            self._submit([i for i in dict.fromkeys(again) if not self._owing(i)])
        while start < limit:
            stop = min(start + batch, limit)
            if stop - start < batch and stop < self.plan_len:
                break  # wait until a whole batch fits in the window
            if repeats:  # a planned repeat no request covers is owed a read of its own
                indices = []
                taken: set[Any] = set()
                for i in plan[start:stop]:
                    if i in taken or self._owing(i):
                        if i in repeats:
                            self.owed[i] = self.owed.get(i, 0) + 1
                    else:
                        taken.add(i)
                        indices.append(i)
            else:
                indices = [i for i in plan[start:stop] if i not in ready and i not in inflight]
            self.requested = start = stop
            if indices:
                self._submit(indices)

    def _rewound(self) -> None:
        """``requested`` went back to ``pos``: the positions after it are walked again by
        `_top_up()`, where a repeat's read that is ready or in flight (made for one of
        them) must not count as owing that position a read of its own."""
        self.owed = {i: -1 for i in self.repeats if self._owing(i)} if self.repeats else {}

    def _owing(self, index: Any) -> bool:
        """Whether a read of ``index`` is already ready or in flight (then a planned repeat
        of it is owed a read of its own, made when that one is taken)."""
        return index in self.ready or index in self.inflight

    def _repay(self, index: Any) -> None:
        """``index`` was taken: a repeat of it that no request covers gets its read."""
        owed = self.owed.get(index, 0)
        if owed > 0:
            self.owed[index] = owed - 1
            self.again.append(index)

    def _advance(self, index: Any) -> bool:
        """Move the plan past ``index``; False when the plan does not go there."""
        plan, pos = self.plan, self.pos
        if pos < self.plan_len and plan[pos] == index:
            if not pos and self.tentative and self.replan is not None:
                # a guess drawn before the loop moved the order on (set_epoch): its first
                # read is asked again, not taken as proof (epochs may share a first index)
                self.tentative = False
                if self._next_epoch(index):
                    return self._advance(index)
            self.pos = pos + 1
            self.guessed = False
            return True
        for p in range(pos + 1, min(self.plan_len, max(self.requested, pos) + 1)):
            if plan[p] == index:  # skipped ahead within the requested window
                self.pos = p + 1
                self.guessed = False
                return True
        if self.replan is not None and (pos >= self.plan_len or (pos == 0 and self.guessed)):
            # the next epoch of an order, or the guess of it disproved by its first read
            return self._next_epoch(index) and self._advance(index)
        return False

    def _followed(self, on_plan: int, off_plan: int, last: Any) -> None:
        """Count reads the followed order's plan foresaw (``on_plan``) and did not: stop
        read-ahead when it keeps guessing wrong, resume when it guesses right again
        (``last``: the last index read)."""
        if not self.epoch_len:
            return  # no order followed: sequential guesses correct themselves
        if off_plan:
            self.on_plan = 0
            self.off_plan += off_plan
            if self.stopped:  # land the plan on the read: do the next reads follow it?
                if self.where is None:
                    self.where = {index: p for p, index in enumerate(self.plan)}
                at = self.where.get(last)
                if at is not None:
                    self.pos = self.requested = at + 1
            if not self.stopped and self.off_plan >= STOP_AFTER:
                self.stopped = True
                self.times_stopped += 1
                for ticket in self.inflight.values():  # guesses: not waited for any more
                    ticket.abandoned = True
                self.wasted += len(self.ready) + len(self.inflight)
                self.ready.clear()
                self.inflight.clear()
                if self.on_stop is not None:
                    self.on_stop()
        elif on_plan:
            self.off_plan = 0
            if self.stopped:
                self.on_plan += on_plan
                if self.on_plan >= RESUME_AFTER:
                    self.stopped = False
                    self.on_plan = 0
                    self.requested = self.pos

    def _after(self, index: Any, on_plan: bool, in_order: bool) -> None:
        """Plan bookkeeping after an access that was not a plain in-order hit."""
        self._followed(in_order, not in_order, index)
        self.drop_stale()
        if on_plan:
            if self.requested - self.pos <= self.window - self.batch:
                self._top_up()
        elif (self.window and self.length is not None and type(index) is int
              and type(self.last_index) is int and index == self.last_index + 1):
            self._sequential_from(index)
        self.last_index = index

    def _sequential_from(self, last: int) -> None:
        """Switch to sequential read-ahead after ``last`` (off-plan contiguous access)."""
        if self.length is not None and last + 1 < self.length:
            self._set_plan(range(last + 1, self.length))

    def _special_in_order(self, index: Any, value: Any) -> Any:
        """The fast path's miss or failure (already counted as a fast read): read again
        if the epoch clock turns with this read, else as buffered."""
        if self._epoch_turned(self.fast_reads + self.slow_reads - 1):
            self.fast_reads -= 1  # counted again, as a direct read
            self.slow_reads += 1
            self.wasted += 1
            ticket = self._start_direct([index])  # before the read-ahead below
            self._top_up()
            return self._result(self._end_direct(ticket)[0])
        if self.requested - self.pos <= self.window - self.batch:
            self._top_up()
        return self._special(value)

    def _count_slow(self, n: int) -> None:
        """``n`` reads off the fast path: the epoch clock may turn before them."""
        self._epoch_turned(self.fast_reads + self.slow_reads)
        self.slow_reads += n

    def _special(self, value: Any) -> Any:
        """A buffered value that is not a plain hit (the fast path counted it as one)."""
        self.fast_specials += 1
        return self._result(value)

    def _refresh_order(self) -> None:
        if self.stale_order and self.follow_order is not None:
            self.stale_order = False
            order = self.follow_order()
            if order is not None:
                self._follow(*order)

    # -- consumer API -----------------------------------------------------------------------
    def take(self, index: Any) -> Any:
        """The value for ``index`` (MISSING on a store miss); read now if not planned.

        An exception at any moment inside (an interrupt) costs at most the value being
        taken, never the next call's correctness (see `_guarded`)."""
        value = self.ready.pop(index, NOTHING)
        if value is not NOTHING and not self.broken:
            pos = self.pos
            if (pos < self.plan_len and self.plan[pos] == index  # the common case, inlined
                    and (pos or not self.tentative)):
                self.pos = pos + 1
                self.last_index = index
                self.fast_reads += 1
                if value is MISSING or type(value) is Failed:
                    return self._guarded(self._special_in_order, index, value)
                if self.owed:
                    self._repay(index)
                if self.requested - pos - 1 <= self.window - self.batch or self.again:
                    self.broken = True  # (the fast path's one guarded step)
                    self._top_up()
                    self.broken = False
                return value
        return self._guarded(self._take_slow, index, value)

    def _take_slow(self, index: Any, value: Any) -> Any:
        """`take()` off its fast path: ``value`` is what the buffer held (or NOTHING)."""
        if value is not NOTHING:
            self._repay(index)
            self._refresh_order()
            self._count_slow(1)
            in_order = self.pos < self.plan_len and self.plan[self.pos] == index
            self._after(index, self._advance(index), in_order)
            if value is MISSING:  # out of plan order: it may be older than a write since
                return self._result(self._read_direct([index])[0])
            self.prefetch_hits += served(value)
            return self._result(value)
        self._refresh_order()
        self._count_slow(1)
        in_order = self.pos < self.plan_len and self.plan[self.pos] == index
        on_plan = self._advance(index)
        value = self._await(index)
        if value is NOTHING or (value is MISSING and not in_order):
            # sent before the read-ahead _after may start: behind it, this read would
            # wait for all of it (a new epoch's first window: tens of MiB of large values)
            ticket = self._start_direct([index])
            self._after(index, on_plan, in_order)
            return self._result(self._end_direct(ticket)[0])
        self._after(index, on_plan, in_order)
        return self._result(value)

    def take_many(self, indices: Sequence[Any]) -> list[Any]:
        """Values for a whole batch: ready ones, awaited ones, then one request for the rest."""
        return self._guarded(self._take_many, indices)

    def _take_many(self, indices: Sequence[Any]) -> list[Any]:
        self._refresh_order()
        self._count_slow(len(indices))  # the clock first: before a stale miss is taken
        self._deliver(self.reader.poll())  # whatever arrived since the last read
        pop = self.ready.pop
        out = [pop(i, NOTHING) for i in indices]
        if self.owed:
            for i, value in zip(indices, out):
                if value is not NOTHING:
                    self._repay(i)
        if len(set(indices)) < len(indices):
            # a repeat inside the batch is the same value (the pipe hands each position
            # an object of its own): not a read of its own
            first: dict[Any, Any] = {}
            for n, (i, value) in enumerate(zip(indices, out)):
                if value is NOTHING and first.get(i, NOTHING) is not NOTHING:
                    out[n] = first[i]
                elif value is not NOTHING:
                    first.setdefault(i, value)
        contiguous = (bool(indices) and type(indices[0]) is int
                      and type(self.last_index) is int and indices[0] == self.last_index + 1
                      and all(b == a + 1 for a, b in itertools.pairwise(indices)))
        on_plan = False
        in_order = []
        foreseen = 0
        for n, index in enumerate(indices):
            in_order.append(self.pos < self.plan_len and self.plan[self.pos] == index)
            foreseen += in_order[n]  # the plan's next index: foreseen (a skip is not)
            on_plan = self._advance(index) or on_plan
            value = out[n]
            if value is MISSING and not in_order[n]:
                out[n] = NOTHING  # out of plan order: it may be older than a write since
            elif value is not NOTHING and served(value):
                self.prefetch_hits += 1
        todo = []
        for n, value in enumerate(out):
            if value is NOTHING:
                value = out[n] = self._await(indices[n])
                if value is NOTHING or (value is MISSING and not in_order[n]):
                    todo.append(n)
        direct = None
        if todo:  # sent before the read-ahead below: it must not queue behind it
            direct = self._start_direct(list(dict.fromkeys(indices[n] for n in todo)))
        if indices:
            self._followed(foreseen, len(indices) - foreseen, indices[-1])
            self.drop_stale()
            if on_plan:
                self._top_up()
            elif contiguous and self.window and self.length is not None:
                self._sequential_from(indices[-1])
            self.last_index = indices[-1]
        if direct is not None:
            fetched = dict(zip(direct.indices, self._end_direct(direct)))
            for n in todo:
                out[n] = fetched[indices[n]]
        return [self._result(v) for v in out]

    def drop_stale(self) -> None:
        """Forget ready values the consumer skipped, so the buffer stays bounded."""
        if len(self.ready) <= 2 * self.window + self.batch:
            return
        # what was requested ahead on the plan is not stale, even beyond a window that
        # has shrunk since (the values' sizes became known): only what was skipped is
        upcoming = set(self.plan[self.pos : max(self.requested, self.pos + self.window)])
        for index in [i for i in self.ready if i not in upcoming]:
            if self.ready.pop(index, NOTHING) is not NOTHING:
                self.wasted += 1
