"""The prefetcher: keeps the next ``prefetch`` planned indices in flight or ready.

It runs on the consumer's side of the loop thread. The consumer thread owns the plan
(which indices come next) and a *ready buffer*; the loop thread fills the buffer one
batch at a time and wakes the consumer with one ``Condition.notify_all`` per batch —
never one ``Future`` per item, because a thread hop per item costs more than the cached
read it waits for.

The plan, best first: an explicit ``order``; iteration over the pipe (0..n-1); or
sequential read-ahead once two consecutive indices were asked for. A wrong guess costs
at most one window of reads: results for indices the consumer skipped are dropped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .core import MISSING, AsyncKVCache
from .errors import CacheError
from .loop import LoopThread

__all__ = ["Prefetcher"]

_FAILED = object()


class Prefetcher:
    """Read-ahead over ``cache`` for store keys given by ``key_of(index)``."""

    def __init__(self, cache: AsyncKVCache, loop: LoopThread, key_of: Callable[[int], bytes],
                 length: int, prefetch: int, wait_timeout: float) -> None:
        self.cache = cache
        self.loop = loop
        self.key_of = key_of
        self.length = length
        self.window = max(0, prefetch)
        self.batch = max(1, min(64, self.window // 4 or 1))
        self.wait_timeout = wait_timeout
        self.cond = threading.Condition(threading.Lock())
        self.ready: dict[int, Any] = {}        # index -> value (MISSING: store miss)
        self.inflight: set[int] = set()
        self.error: BaseException | None = None
        self.tasks: set[asyncio.Task[Any]] = set()  # loop thread only; strong refs
        self.plan: Sequence[int] = ()
        self.pos = 0                           # plan position of the next expected index
        self.requested = 0                     # plan positions below this were requested
        self.generation = 0
        self.last_index = -2
        self.sequential = False
        self.counts = {"prefetch_hits": 0, "stalls": 0, "stall_us": 0, "direct_reads": 0,
                       "prefetch_wasted": 0, "stall_timeouts": 0}

    # -- plan ---------------------------------------------------------------------------
    def set_plan(self, plan: Sequence[int], sequential: bool = False) -> None:
        """Start following ``plan`` from its beginning (old read-ahead is discarded)."""
        with self.cond:
            self.generation += 1
            self.counts["prefetch_wasted"] += len(self.ready)
            self.ready.clear()
            self.inflight.clear()
            self.plan, self.pos, self.requested = plan, 0, 0
            self.sequential = sequential
            self._top_up()

    def _advance(self, index: int) -> bool:
        """Move the plan past ``index``; False when ``index`` is not where the plan goes."""
        plan, pos = self.plan, self.pos
        if pos < len(plan) and plan[pos] == index:
            self.pos = pos + 1
            return True
        end = min(len(plan), max(self.requested, pos) + 1)
        for p in range(pos + 1, end):  # skipped ahead within the requested window
            if plan[p] == index:
                self.pos = p + 1
                return True
        return False

    def _top_up(self) -> None:
        """Request planned indices until ``window`` of them are ahead (lock held)."""
        if self.window == 0:
            return
        limit = min(len(self.plan), self.pos + self.window)
        while True:
            start = max(self.requested, self.pos)
            stop = min(start + self.batch, limit)
            if stop <= start or (stop - start < self.batch and stop < len(self.plan)):
                return  # nothing to ask, or wait until a whole batch fits the window
            indices = [i for i in self.plan[start:stop]
                       if i not in self.ready and i not in self.inflight]
            self.requested = stop
            if indices:
                self.inflight.update(indices)
                self.loop.call_soon(self._start_fetch, indices, self.generation)

    # -- loop side ----------------------------------------------------------------------
    def _start_fetch(self, indices: list[int], generation: int) -> None:
        keys = [self.key_of(i) for i in indices]
        task = self.loop.loop.create_task(self.cache.fetch(keys))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda t: self._fetched(indices, generation, t))

    async def cancel_pending(self) -> None:
        """Cancel read-ahead still in flight and wait for it (loop thread)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _fetched(self, indices: list[int], generation: int, task: Any) -> None:
        if task.cancelled():
            values: list[Any] = [MISSING] * len(indices)
        elif task.exception() is not None:
            values = [_FAILED] * len(indices)
            self.error = task.exception()
        else:
            values = task.result()
        with self.cond:
            if generation == self.generation:
                for index, value in zip(indices, values):
                    if index in self.inflight:
                        self.inflight.discard(index)
                        self.ready[index] = value
            self.cond.notify_all()

    # -- consumer side ------------------------------------------------------------------
    def take(self, index: int) -> Any:
        """The prefetched value for ``index``, MISSING on a store miss, or fetch it now."""
        with self.cond:
            on_plan = self._advance(index)
            if not on_plan and self.window:
                on_plan = self._follow_access(index)
            self.last_index = index
            value = self._wait_ready(index)
            if on_plan:
                self._drop_passed()
                self._top_up()
        if value is _FAILED:
            raise self._error()
        if value is not _NOT_PLANNED:
            return value
        self.counts["direct_reads"] += 1
        return self.loop.call(self.cache.fetch([self.key_of(index)]))[0]

    def take_many(self, indices: Sequence[int]) -> list[Any]:
        """Values for a whole batch: ready ones, then one request for the rest."""
        out: list[Any] = [_NOT_PLANNED] * len(indices)
        with self.cond:
            for n, index in enumerate(indices):
                self._advance(index)
                if index in self.ready or index in self.inflight:
                    out[n] = self._wait_ready(index)
            if self.plan:
                self._drop_passed()
                self._top_up()
        if any(v is _FAILED for v in out):
            raise self._error()
        todo = [n for n, v in enumerate(out) if v is _NOT_PLANNED]
        if todo:
            self.counts["direct_reads"] += len(todo)
            values = self.loop.call(self.cache.fetch([self.key_of(indices[n]) for n in todo]))
            for n, value in zip(todo, values):
                out[n] = value
        return out

    def _wait_ready(self, index: int) -> Any:
        """Pop ``index`` from the ready buffer, waiting if it is in flight (lock held)."""
        if index in self.ready:
            self.counts["prefetch_hits"] += 1
            return self.ready.pop(index)
        if index not in self.inflight:
            return _NOT_PLANNED
        self.counts["stalls"] += 1
        started = time.perf_counter()
        deadline = started + self.wait_timeout
        while index not in self.ready:
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or (index not in self.inflight and index not in self.ready):
                self.counts["stall_timeouts"] += remaining <= 0
                self.inflight.discard(index)
                return MISSING
            self.cond.wait(remaining)
        self.counts["stall_us"] += int((time.perf_counter() - started) * 1e6)
        return self.ready.pop(index)

    def _follow_access(self, index: int) -> bool:
        """Off-plan access: switch to sequential read-ahead after two in a row (lock held).

        Returns True when a new plan starts (so the caller requests its first window).
        """
        if index == self.last_index + 1 and index + 1 < self.length:
            self.generation += 1
            self.ready.clear()
            self.inflight.clear()
            self.plan, self.pos, self.requested = range(index + 1, self.length), 0, 0
            self.sequential = True
            return True
        return False

    def _drop_passed(self) -> None:
        """Forget ready values the consumer has skipped, so the buffer stays bounded."""
        if len(self.ready) <= self.window + self.batch:
            return
        upcoming = set(self.plan[self.pos : self.pos + self.window])
        for index in [i for i in self.ready if i not in upcoming]:
            del self.ready[index]
            self.counts["prefetch_wasted"] += 1

    def _error(self) -> BaseException:
        error = self.error or CacheError("prefetch failed")
        self.error = None
        return error


class _NotPlanned:
    def __repr__(self) -> str:
        return "NOT_PLANNED"


_NOT_PLANNED: Any = _NotPlanned()
