"""Concurrent callers of one event loop share work: ``get()`` calls of one loop tick become
one multi-get (emcache's autobatching), and ``get_or_compute()`` calls for one key one
computation. Every waiter is resolved on every path, errors and cancellation included,
and every caller gets an object of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

from ..errors import CacheError
from ..observe.stats import Counters
from .markers import MISSING, Failed

__all__ = ["Coalescer", "Computed", "SharedComputation"]

#: ``read(store_keys)``: a value (or ``MISSING`` / `Failed`) per key
Read = Callable[[Sequence[bytes]], Awaitable[list[Any]]]
#: ``copy_of(store_key, value)``: an object of its own with ``value``'s content
CopyOf = Callable[[bytes, Any], Any]


class Coalescer:
    """The ``get()`` calls of one cache in one loop, gathered per loop tick."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read: Read, copy_of: CopyOf,
                 counters: Counters, spawn: Callable[[Awaitable[Any]], Any]) -> None:
        self.loop = loop
        self.read = read
        self.copy_of = copy_of
        self.counters = counters
        self.spawn = spawn
        self.pending: dict[bytes, list[asyncio.Future[Any]]] = {}
        self.flush_scheduled = False

    def get(self, store_key: bytes) -> asyncio.Future[Any]:
        """A future for ``store_key``'s value (``MISSING`` for a miss), read with every
        other key asked for in this loop tick."""
        fut: asyncio.Future[Any] = self.loop.create_future()
        waiters = self.pending.get(store_key)
        if waiters is None:
            self.pending[store_key] = [fut]
        else:
            waiters.append(fut)
            self.counters.shard()["coalesced"] += 1
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        pending, self.pending, self.flush_scheduled = self.pending, {}, False
        if pending:
            self.spawn(self._resolve(pending))

    async def _resolve(self, pending: dict[bytes, list[asyncio.Future[Any]]]) -> None:
        keys = list(pending)
        try:
            values = await self.read(keys)
        except BaseException as exc:  # every waiter must be resolved on every path
            failure = exc if isinstance(exc, Exception) else CacheError("cache read was cancelled")
            for waiters in pending.values():
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            return
        for key, value in zip(keys, values):
            given = False
            for fut in pending[key]:
                if fut.done():
                    continue
                if type(value) is Failed:
                    fut.set_exception(value.error)
                elif not given or value is MISSING:
                    fut.set_result(value)
                    given = True
                else:  # coalesced callers of one key: each gets an object of its own
                    try:
                        fut.set_result(self.copy_of(key, value))
                    except CacheError as exc:
                        fut.set_exception(exc)


class Computed(NamedTuple):
    """What one computation hands its callers: the value, and the bytes every caller but
    the first decodes its own object from -- encoded when the computation ended, before any
    caller resumed, so no caller's change in place can reach another's copy. ``blob`` is
    None for values nobody can change (ints, str, ...); ``error`` says why a value could
    not be encoded (a second caller then gets that error, never the shared object)."""

    value: Any
    blob: bytes | None
    error: CacheError | None = None


#: ``decode(blob, store_key)``: a fresh object from a `Computed`'s bytes (``Codec.decode``)
Decode = Callable[[bytes, bytes], Any]


class SharedComputation:
    """One computation that several callers await: the first caller to take its result
    gets the object, every other one an object decoded from the bytes made when it ended.

    ``task`` returns a `Computed`, or (a batch, ``cached_many``) a dict of them by store
    key; ``store_key`` then picks this caller's entry (``MISSING`` when the batch left it
    out)."""

    __slots__ = ("batch", "store_key", "taken", "task")

    def __init__(self, task: asyncio.Task[Any], store_key: bytes, *, batch: bool = False
                 ) -> None:
        self.task = task
        self.store_key = store_key
        self.batch = batch
        self.taken = False

    async def result(self, decode: Decode) -> Any:
        outcome = await asyncio.shield(self.task)
        if self.batch:
            outcome = outcome.get(self.store_key)
            if outcome is None:
                return MISSING
        value, blob, error = outcome
        if not self.taken:
            self.taken = True
            return value
        if error is not None:
            raise error
        return value if blob is None else decode(blob, self.store_key)
