"""The prefetcher: keeps the next ``prefetch`` planned indices in flight or ready.

Two threads share it. The **consumer** (the thread calling ``dp[i]``) owns the plan —
which indices come next — and asks for batches of them; the **loop thread** answers
each batch by updating a *ready* dict in one C-level ``dict.update`` and wakes the
consumer only if it is waiting. A hit therefore costs the consumer one ``dict.pop``
and a plan comparison: no lock, no ``Future``, no thread hop per item. (A per-item
hand-off costs more than the cached read it waits for; see the issue notes for the
measurements.)

Ordering rule that makes the lock-free read safe: the loop thread adds values to
``ready`` *before* it removes their indices from ``inflight``, and checks ``waiting``
*after* both. A consumer that finds an index in neither is certain it was never
requested (or was dropped), and one that waits is always woken.

The plan, best first: an explicit ``order`` (re-iterated when used up); iteration over
the pipe (0..n-1); or sequential read-ahead once two consecutive indices (or two
contiguous batches) were asked for. A wrong guess costs at most one window of reads.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .clients.blocking_resp import BlockingRespReader
from .core import MISSING, AsyncKVCache
from .errors import CacheError, StoreError
from .loop import LoopThread

__all__ = ["Prefetcher"]


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_NOTHING: Any = _Sentinel("NOTHING")   # not in the ready buffer
_FAILED: Any = _Sentinel("FAILED")     # the batch failed (on_error="raise")

#: stats() name -> attribute holding it
_COUNTERS = {"prefetch_hits": "hits", "stalls": "stalls", "stall_us": "stall_us",
             "direct_reads": "direct_reads", "prefetch_wasted": "wasted",
             "stall_timeouts": "stall_timeouts"}

#: Smallest and largest read-ahead request, in keys. Each request costs ~60–90 µs of
#: client CPU whatever its size, so batches are as large as the window allows.
MIN_BATCH = 16
MAX_BATCH = 256


def batch_size_for(window: int) -> int:
    """Keys per read-ahead request for a window: two requests in flight when possible."""
    if window <= 0:
        return 0
    return max(min(window, MIN_BATCH), min(MAX_BATCH, window // 2))


class Prefetcher:
    """Read-ahead over ``cache`` for store keys given by ``key_of(index)``."""

    def __init__(self, cache: AsyncKVCache, loop: LoopThread, key_of: Callable[[int], bytes],
                 length: int, prefetch: int, wait_timeout: float,
                 reader: BlockingRespReader | None = None) -> None:
        self.cache = cache
        #: consumer-driven reads (plain Redis): requests sent and replies parsed in the
        #: consumer thread; None: reads go through the loop thread
        self.reader = reader
        self.sent: collections.deque[tuple[list[int], list[bytes]]] = collections.deque()
        self.loop = loop
        self.key_of = key_of
        self.length = length
        self.window = max(0, prefetch)
        self.batch = batch_size_for(self.window)
        self.wait_timeout = wait_timeout
        # shared with the loop thread (see the module docstring for the ordering rule)
        self.ready: dict[int, Any] = {}
        self.inflight: set[int] = set()
        self.waiting = False
        self.cond = threading.Condition(threading.Lock())
        self.error: BaseException | None = None
        self.tasks: set[asyncio.Task[Any]] = set()  # loop thread only: strong refs
        # consumer thread only
        self.plan: Sequence[int] = ()
        self.plan_len = 0
        self.order: Iterable[int] | None = None  # re-iterated when the plan runs out
        self.pos = 0          # plan position of the next expected index
        self.requested = 0    # plan positions below this have been requested
        self.generation = 0
        self.last_index = -2
        self.hits = self.stalls = self.stall_us = self.direct_reads = 0
        self.wasted = self.stall_timeouts = 0

    @staticmethod
    def zero_counts() -> dict[str, int]:
        return dict.fromkeys(_COUNTERS, 0)

    @property
    def counts(self) -> dict[str, int]:
        return {name: getattr(self, attr) for name, attr in _COUNTERS.items()}

    # -- plan (consumer thread) ----------------------------------------------------------
    def set_plan(self, plan: Sequence[int], order: Iterable[int] | None = None) -> None:
        """Follow ``plan`` from its start; with ``order``, re-iterate it when used up."""
        self.generation += 1
        self.wasted += len(self.ready)
        self.ready.clear()
        self.inflight.clear()
        self.plan, self.plan_len, self.pos, self.requested = plan, len(plan), 0, 0
        self.order = order
        self._top_up()

    def _top_up(self) -> None:
        """Request planned indices, a batch at a time, while the window has room."""
        window, batch, plan = self.window, self.batch, self.plan
        if window == 0:
            return
        limit = min(self.plan_len, self.pos + window)
        start = max(self.requested, self.pos)
        while start < limit:
            stop = min(start + batch, limit)
            if stop - start < batch and stop < self.plan_len:
                break  # wait until a whole batch fits in the window
            ready, inflight = self.ready, self.inflight
            indices = [i for i in plan[start:stop] if i not in ready and i not in inflight]
            self.requested = start = stop
            if indices and not self._request(indices):
                self.requested = min(self.requested, self.pos)  # try the window again later
                return

    def _request(self, indices: list[int], direct: bool = False) -> bool:
        """Ask the store for ``indices``: on this thread's socket, or via the loop.

        False when the store is skipped (back-off) or failed. A *direct* request (the
        consumer waits for it) then gets misses in the ready buffer; read-ahead gets
        nothing, so that no stale miss outlives the failure.
        """
        if self.reader is None:
            self.inflight.update(indices)
            self.loop.call_soon(self._start_fetch, indices, self.generation)
            return True
        cache = self.cache
        if cache._store_is_down():  # back-off after a failure: do not even try
            cache.count("skipped", len(indices))
            if direct:
                cache.count("keys_requested", len(indices))
                self.ready.update(zip(indices, cache.count_hits([MISSING] * len(indices))))
            return False
        keys = [self.key_of(i) for i in indices]
        try:
            self.reader.send_mget(keys)  # replies are read when first needed (_wait)
        except StoreError as exc:
            self._reader_failed(exc, indices if direct else ())
            return False
        cache.count("keys_requested", len(indices))
        self.sent.append((indices, keys))
        self.inflight.update(indices)
        return True

    def _drain(self, block: bool) -> bool:
        """Deliver the oldest reply (waiting for it with ``block``) and every reply
        that came with it, parsed from bytes already received. False: none arrived."""
        reader, cache = self.reader, self.cache
        blobs = reader.receive_mget(block)  # type: ignore[union-attr]
        delivered = blobs is not False
        while blobs is not False:
            indices, keys = self.sent.popleft()
            values, manifests = cache.decode_blobs(keys, blobs)  # type: ignore[arg-type]
            if manifests:  # chunked values: their chunks come through the core's loop
                self.loop.call(cache.resolve_chunks(keys, manifests, values))
            cache.count("batches")
            self.ready.update(zip(indices, cache.count_hits(values)))
            self.inflight.difference_update(indices)
            # the replies that came with it, parsed without another system call
            blobs = reader.receive_mget(False, recv=False) if self.sent else False  # type: ignore[union-attr]
        return delivered

    def _reader_failed(self, exc: StoreError, direct: Sequence[int] = ()) -> None:
        """The socket failed: what was on the wire is dropped (its waiters re-read,
        which the back-off turns into misses), ``direct`` indices become misses now, and
        the failure is counted and logged by the cache (raised in ``raise`` mode)."""
        lost = [i for batch, _keys in self.sent for i in batch]
        self.sent.clear()
        self.reader.close()  # type: ignore[union-attr]
        self.inflight.difference_update(lost)
        self.requested = min(self.requested, self.pos)  # re-request the window later
        if self.cache.on_error == "raise":
            self.ready.update(dict.fromkeys([*lost, *direct], _FAILED))
            self.error = exc
            return
        self.cache.count("keys_requested", len(direct))
        self.ready.update(zip(direct, self.cache.count_hits([MISSING] * len(direct))))
        self.cache._store_failed("get", exc)

    def _advance(self, index: int) -> bool:
        """Move the plan past ``index``; False when the plan does not go there."""
        plan, pos = self.plan, self.pos
        if pos < self.plan_len and plan[pos] == index:
            self.pos = pos + 1
            return True
        for p in range(pos + 1, min(self.plan_len, max(self.requested, pos) + 1)):
            if plan[p] == index:  # skipped ahead within the requested window
                self.pos = p + 1
                return True
        if pos >= self.plan_len and self.order is not None:  # next epoch of an order
            self.set_plan(list(self.order), self.order)
            return self._advance(index)
        return False

    def _sequential_from(self, last: int) -> None:
        """Switch to sequential read-ahead after ``last`` (off-plan contiguous access)."""
        if last + 1 < self.length:
            self.set_plan(range(last + 1, self.length))

    def _after(self, index: int, on_plan: bool) -> None:
        """Plan bookkeeping after an access that was not a plain in-order hit."""
        self.drop_stale()
        if on_plan:
            if self.requested - self.pos <= self.window - self.batch:
                self._top_up()
        elif self.window and index == self.last_index + 1:
            self._sequential_from(index)
        self.last_index = index

    # -- loop thread ----------------------------------------------------------------------
    def _start_fetch(self, indices: list[int], generation: int) -> None:
        task = self.loop.loop.create_task(self._fetch(indices, generation))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _fetch(self, indices: list[int], generation: int) -> None:
        key_of = self.key_of
        values: list[Any] | None = None
        try:
            values = await self.cache.fetch([key_of(i) for i in indices], failed_as_none=True)
        except Exception as exc:  # raise mode: the consumer re-raises it
            self.error = exc
            values = [_FAILED] * len(indices)
        finally:  # cancelled too: every waiter must be woken
            self._deliver(indices, values, generation)

    def _deliver(self, indices: list[int], values: list[Any] | None, generation: int) -> None:
        if values is not None and generation == self.generation:
            self.ready.update(zip(indices, values))
        self.inflight.difference_update(indices)
        if self.waiting:
            with self.cond:
                self.cond.notify_all()

    async def cancel_pending(self) -> None:
        """Cancel read-ahead still in flight and wait for it (loop thread)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- consumer side ------------------------------------------------------------------------
    def take(self, index: int) -> Any:
        """The value for ``index`` (MISSING on a store miss); fetched now if not planned."""
        value = self.ready.pop(index, _NOTHING)
        if value is not _NOTHING:
            self.hits += 1
            pos = self.pos
            if pos < self.plan_len and self.plan[pos] == index:  # the common case, inlined
                self.pos = pos + 1
                self.last_index = index
                if self.requested - pos - 1 <= self.window - self.batch:
                    self._top_up()
            else:
                self._after(index, self._advance(index))
                if value is MISSING:
                    # a read-ahead miss not consumed in plan order may be stale: ask again
                    self.hits -= 1
                    self.direct_reads += 1
                    value = self._read_now([index])[0]
        else:
            on_plan = self._advance(index)
            value = self._wait(index)
            self._after(index, on_plan)
            if value is _NOTHING:
                self.direct_reads += 1
                value = self._read_now([index])[0]
        if value is _FAILED:
            raise self._error()
        return value

    def take_many(self, indices: Sequence[int]) -> list[Any]:
        """Values for a whole batch: ready ones, awaited ones, then one request for the rest."""
        pop, advance = self.ready.pop, self._advance
        out = [pop(i, _NOTHING) for i in indices]
        contiguous = bool(indices) and indices[0] == self.last_index + 1 and all(
            b == a + 1 for a, b in itertools.pairwise(indices))
        in_order: list[bool] = []
        on_plan = False
        for index in indices:
            in_order.append(self.pos < self.plan_len and self.plan[self.pos] == index)
            on_plan = advance(index) or on_plan
        for n, value in enumerate(out):
            if value is MISSING and not in_order[n]:
                out[n] = _NOTHING  # a read-ahead miss not consumed in plan order may be stale
        todo = []
        for n, value in enumerate(out):
            if value is _NOTHING:
                value = out[n] = self._wait(indices[n])
                if value is _NOTHING:
                    todo.append(n)
            else:
                self.hits += 1
        if indices:
            if on_plan:
                self._top_up()
            elif contiguous and self.window:
                self._sequential_from(indices[-1])
            self.last_index = indices[-1]
        if todo:
            self.direct_reads += len(todo)
            values = self._read_now([indices[n] for n in todo])
            for n, value in zip(todo, values):
                out[n] = value
        if any(v is _FAILED for v in out):
            raise self._error()
        return out

    def _read_now(self, indices: list[int]) -> list[Any]:
        """Values for indices nobody requested yet: one request, waited for."""
        self.loop.check_caller()  # blocking here would stall (or deadlock) the loop
        if self.reader is None:
            return self.loop.call(self.cache.fetch([self.key_of(i) for i in indices]))
        unique = list(dict.fromkeys(indices))
        self._request(unique, direct=True)
        values = {i: self._wait(i, read_ahead=False) for i in unique}
        return [MISSING if values[i] is _NOTHING else values[i] for i in indices]

    def _wait(self, index: int, read_ahead: bool = True) -> Any:
        """Wait for ``index`` if it is in flight; ``_NOTHING`` if it was never requested.

        ``read_ahead``: the index was requested ahead (its arrival counts as a prefetch
        hit, its wait as a stall); False for a direct read the consumer asked for now."""
        if index not in self.inflight:
            return self.ready.pop(index, _NOTHING)  # delivered just now, or not planned
        if self.reader is not None:
            started = 0.0
            while index in self.inflight:
                try:
                    if not self._drain(block=False):  # not here yet: a real stall
                        if not started:
                            started = time.perf_counter()
                            self.stalls += read_ahead
                        self._drain(block=True)
                except StoreError as exc:
                    self._reader_failed(exc)
            if started:
                self.stall_us += int((time.perf_counter() - started) * 1e6)
            else:
                self.hits += read_ahead  # it had arrived: only its parsing was deferred
            return self.ready.pop(index, _NOTHING)
        self.stalls += 1
        started = time.perf_counter()
        deadline = started + self.wait_timeout
        with self.cond:
            self.waiting = True
            try:
                while index not in self.ready and index in self.inflight:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        self.stall_timeouts += 1
                        return MISSING  # the store is too slow: compute it instead
                    self.cond.wait(remaining)
            finally:
                self.waiting = False
        self.stall_us += int((time.perf_counter() - started) * 1e6)
        return self.ready.pop(index, _NOTHING)

    def drop_stale(self) -> None:
        """Forget ready values the consumer skipped, so the buffer stays bounded."""
        if len(self.ready) <= 2 * self.window + self.batch:
            return
        upcoming = set(self.plan[self.pos : self.pos + self.window])
        for index in [i for i in self.ready if i not in upcoming]:
            if self.ready.pop(index, _NOTHING) is not _NOTHING:
                self.wasted += 1

    def close(self) -> None:
        """Close the consumer-side socket (in-flight read-ahead is dropped)."""
        if self.reader is not None:
            self.reader.close()
        self.sent.clear()
        self.inflight.clear()

    def _error(self) -> BaseException:
        error = self.error or CacheError("prefetch failed")
        self.error = None
        return error
