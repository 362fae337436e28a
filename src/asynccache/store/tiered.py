"""``Tiered(near, far)``: a client made of two stores, a machine-local one in front of a
shared one.

Reads ask ``near`` first and ``far`` for what it lacks; far's hits are copied into near
behind the read (bounded, never raising); writes go to both at once; leases are far's
alone. Its nodes are near's and far's, so the cache backs off each one as it would any
node. Why each choice: docs/stores.md, "Tiers".
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, StoreError
from .api import (
    NOT_READ,
    READ_TTL,
    BaseClient,
    ConsumerReads,
    NodeName,
    ReadResult,
    WriteResult,
    count,
)

__all__ = ["COPY_BYTES", "PAUSE_MAX", "PAUSE_START", "Tiered"]

logger = logging.getLogger("asynccache")

#: Bytes of far hits being copied into near at once, by default: past it a hit is served
#: and not copied (``tier_near_dropped``); a slow near never holds more than this.
COPY_BYTES = 64 << 20
#: After near refused a copy or a write (full) or failed one, nothing is written to it
#: for this long, doubling up to ``PAUSE_MAX`` while it keeps refusing: a full LMDB map
#: is not asked again for every batch (it would try each key in a transaction of its own).
PAUSE_START = 1.0
PAUSE_MAX = 30.0
#: Keys written lately that ``_Copies`` keeps at least (it drops those no open read can
#: be older than once it holds more than this, or twice what it kept last time).
KEEP_WRITTEN = 4096


@dataclass
class _Copies:
    """This loop's copies into near: bytes in flight, their tasks, the pause; and what
    keeps a copy from landing over a write: the writes under way and done lately, and
    the reads whose copies are not sent yet."""

    pending: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    paused_until: float = 0.0
    pause: float = PAUSE_START
    #: writes and deletes done in this loop (numbers them)
    done: int = 0
    #: key -> writes and deletes of it under way
    writing: dict[bytes, int] = field(default_factory=dict)
    #: key -> number of its last write or delete, while a read older than it is open
    written: dict[bytes, int] = field(default_factory=dict)
    #: open reads (their copies not sent yet): token -> ``done`` when the read started
    reads: dict[int, int] = field(default_factory=dict)
    tokens: Iterator[int] = field(default_factory=itertools.count)
    keep: int = KEEP_WRITTEN

    def open_read(self) -> int:
        token = next(self.tokens)
        self.reads[token] = self.done
        return token

    def close_read(self, token: int) -> None:
        """The read's copies are sent (or none will be): forget the writes only reads
        older than every open one could have raced."""
        self.reads.pop(token, None)
        if not self.reads:
            self.written.clear()
        elif len(self.written) > self.keep:
            oldest = min(self.reads.values())
            self.written = {k: n for k, n in self.written.items() if n > oldest}
            self.keep = max(KEEP_WRITTEN, 2 * len(self.written))

    def overtaken(self, token: int, key: bytes) -> bool:
        """A write or delete of ``key`` is under way or ended after the read ``token``
        started: the value that read got from far may be older than near's now."""
        return key in self.writing or self.written.get(key, -1) > self.reads[token]

    @contextlib.contextmanager
    def writes(self, keys: Iterable[bytes]) -> Iterator[None]:
        """Around a write or delete of ``keys`` to both tiers (see `overtaken()`)."""
        keys = list(keys)
        writing = self.writing
        for key in keys:
            writing[key] = writing.get(key, 0) + 1
        try:
            yield
        finally:
            for key in keys:
                left = writing[key] - 1
                if left:
                    writing[key] = left
                else:
                    del writing[key]
            self.done += 1
            if self.reads:  # no open read: none can be older than this write
                self.written.update(dict.fromkeys(keys, self.done))

    def paused(self) -> bool:
        return self.paused_until > 0.0 and time.monotonic() < self.paused_until

    def trouble(self) -> None:
        """Near refused or failed: leave it alone for a while (longer each time)."""
        self.paused_until = time.monotonic() + self.pause
        self.pause = min(self.pause * 2, PAUSE_MAX)

    def fine(self) -> None:
        self.paused_until = 0.0
        self.pause = PAUSE_START


class Tiered(BaseClient[_Copies]):
    """A client made of two: reads ``near`` first, then ``far`` for near's misses.

    ``near`` is what this machine reaches fastest (``lmdb://`` or a local Valkey),
    ``far`` what every machine shares (a Redis, a cluster, a memcached pool). Both are
    clients from `asynccache.connect()` (or another ``Tiered``):

    ```python
    near = ac.connect(f"lmdb://{Path.home()}/.cache/asynccache?map_size=200GiB")
    client = ac.Tiered(near, ac.connect("redis+cluster://h1:7000,h2:7001"))
    ```

    * reads: one read of near, then one read of far for the keys near lacks (or could
      not read); far's hits are copied into near after the read returns, at most
      ``max_copy_bytes`` in flight, expiring after ``copy_ttl`` or the reading cache's
      ttl, whichever is shorter (neither: no expiry);
    * writes: to far and near at once, each with the write's ttl; a value near refuses
      (full) or cannot take is still written to far, and counted;
    * leases (``add_many``): far only, the one store every machine sees;
    * ``delete_many``, ``ping``: both; ``scan``: near's keys, then far's;
    * its nodes are near's and far's: with far down, far's nodes back off like any
      node's and near serves what it holds; keys it lacks are then not read (computed).

    Counters, in keys (a chunked value's chunks count too), in the ``stats()`` of the
    cache or pipe that read: ``tier_near_hits``, ``tier_far_hits``, ``tier_copies``
    (copied into near), ``tier_near_refused`` (refused by near: full),
    ``tier_near_dropped`` (not written to near: copies over ``max_copy_bytes``, copies a
    write of their key overtook, or near refusing or failing lately),
    ``tier_copy_failed`` (copies near failed to take).

    A value overwritten or dropped in far stays in this machine's near until its copy
    expires there: give ``copy_ttl``, or use versioned namespaces (values never change
    under a key). No reads on the consumer's own thread: read-ahead goes through the
    loop (docs/stores.md, "Tiers").
    """

    scheme = "tiered"

    def __init__(self, near: BaseClient[Any], far: BaseClient[Any], *,
                 copy_ttl: float | datetime.timedelta | None = None,
                 max_copy_bytes: int = COPY_BYTES) -> None:
        for name, client in (("near", near), ("far", far)):
            if not isinstance(client, BaseClient):
                raise ConfigError(f"Tiered: {name} must be a client from asynccache.connect(url), "
                                  f"got {type(client).__name__}")
        if near is far or set(near.node_names) & set(far.node_names):
            raise ConfigError(f"Tiered: near and far are the same store ({near.safe_url}); "
                              "near is a store of this machine in front of a shared one: "
                              "give two different stores")
        if isinstance(copy_ttl, datetime.timedelta):  # as every ttl (cache/expiry.py)
            copy_ttl = copy_ttl.total_seconds()
        if copy_ttl is not None and (isinstance(copy_ttl, bool)
                                     or not isinstance(copy_ttl, int | float)
                                     or not math.isfinite(copy_ttl) or copy_ttl <= 0):
            raise ConfigError(f"Tiered: copy_ttl must be a positive number of seconds, a "
                              f"datetime.timedelta or None (copies expire with the "
                              f"reading cache's ttl alone), got {copy_ttl!r}")
        if type(max_copy_bytes) is not int or max_copy_bytes < 0:
            raise ConfigError(f"Tiered: max_copy_bytes must be an int >= 0 (0: never copy far's "
                              f"hits into near), got {max_copy_bytes!r}")
        super().__init__(timeout=near.timeout + far.timeout,
                         connect_timeout=max(near.connect_timeout, far.connect_timeout),
                         max_batch=min(near.max_batch, far.max_batch))
        self.near = near
        self.far = far
        self.copy_ttl = None if copy_ttl is None else float(copy_ttl)
        self.max_copy_bytes = max_copy_bytes
        limits = [c.max_value_size for c in (near, far) if c.max_value_size is not None]
        #: values larger than either store takes are chunked to fit both
        self.max_value_size = min(limits) if limits else None

    # -- configuration, runtime, pickling -------------------------------------------------
    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._warned: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_warned", None)
        return state

    @property
    def expiry_slack(self) -> float:  # type: ignore[override]
        """Far's: leases live there."""
        return self.far.expiry_slack

    @property
    def safe_url(self) -> str:
        return f"tiered(near={self.near.safe_url}, far={self.far.safe_url})"

    def __repr__(self) -> str:
        return f"Tiered(near={self.near!r}, far={self.far!r})"

    @property
    def node_names(self) -> tuple[NodeName, ...]:
        return (*self.near.node_names, *self.far.node_names)

    def consumer_reads(self) -> ConsumerReads | None:
        """None: read-ahead goes through the loop, where a far read follows near's misses
        and far's hits are copied (docs/stores.md, "Tiers", says what it costs)."""
        return None

    def _open_state(self) -> _Copies:
        return _Copies()

    async def _close_state(self, state: _Copies) -> None:
        if state.tasks:  # copies in flight finish (each bounded by near's timeout)
            await asyncio.gather(*state.tasks, return_exceptions=True)

    async def close(self) -> None:
        """Let this loop's copies finish, then close near's and far's connections."""
        await super().close()
        await self.near.close()
        await self.far.close()

    def retain(self) -> None:
        super().retain()
        self.near.retain()
        self.far.retain()

    async def release(self) -> None:
        if not self._forked():
            loop = asyncio.get_running_loop()
            users = self._users.get(loop, 0) - 1
            if users > 0:
                self._users[loop] = users
            else:
                self._users.pop(loop, None)
                await super().close()  # this loop's copies only; near and far count their own
        await self.near.release()
        await self.far.release()

    # -- reads --------------------------------------------------------------------------------
    async def read(self, keys: Sequence[bytes], skip: Collection[NodeName] = ()) -> ReadResult:
        """Near's values; far's for the keys near lacks or could not read. A key near lacks
        and far could not read is ``NOT_READ`` (far may hold it); a key far lacks is absent
        whatever near could read (far is the store of record)."""
        state = self._state()
        token = state.open_read()
        sent = False
        try:
            result, copies = await self._read(keys, skip)
            if copies:
                sent = self._copy(state, token, copies, self._copy_ttl())
            return result
        finally:
            if not sent:
                state.close_read(token)

    async def _read(self, keys: Sequence[bytes], skip: Collection[NodeName]
                    ) -> tuple[ReadResult, dict[bytes, bytes]]:
        """The read, and far's hits to copy into near."""
        near = await self.near.read(keys, skip)
        values = list(near.values)
        wanted = [i for i, value in enumerate(values) if value is None or value is NOT_READ]
        count("tier_near_hits", len(values) - len(wanted))
        if not wanted:
            return near, {}
        far = await self.far.read([keys[i] for i in wanted], skip)
        copies: dict[bytes, bytes] = {}
        for i, value in zip(wanted, far.values):
            if value is NOT_READ:
                values[i] = NOT_READ
                continue
            if value is not None and values[i] is None:  # near answered: it lacks it
                copies[keys[i]] = value if type(value) is bytes else bytes(value)
            values[i] = value
        count("tier_far_hits", sum(1 for v in far.values if v is not None and v is not NOT_READ))
        return ReadResult(values, {**near.failures, **far.failures},
                          [*near.answered, *far.answered], near.skipped + far.skipped), copies

    def _copy_ttl(self) -> float | None:
        """The expiry of copies made for the read under way: ``copy_ttl``, and no longer
        than the reading cache's ttl (`READ_TTL`). Far may have held the value for a
        while, so its own expiry is within that ttl from now: a copy kept longer (or for
        ever) would serve a value far dropped, as would a copy made after near's own
        expiry of the value (memcached rounds up to whole seconds, LMDB does not)."""
        bounds = [t for t in (self.copy_ttl, READ_TTL.get()) if t is not None]
        return min(bounds) if bounds else None

    def _copy(self, state: _Copies, token: int, entries: dict[bytes, bytes],
              ttl: float | None) -> bool:
        """Write far's hits into near behind the read ``token``: what fits in
        ``max_copy_bytes`` (less what is in flight), nothing while near is paused. True
        when a copy was started (it closes the read). Never raises."""
        if state.paused():
            count("tier_near_dropped", len(entries))
            return False
        room = self.max_copy_bytes - state.pending
        batch: dict[bytes, bytes] = {}
        size = 0
        for key, value in entries.items():
            if size + len(value) > room:
                continue
            batch[key] = value
            size += len(value)
        count("tier_near_dropped", len(entries) - len(batch))
        if not batch:
            return False
        state.pending += size
        task = asyncio.get_running_loop().create_task(
            self._copy_now(state, token, batch, size, ttl))
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)
        return True

    async def _copy_now(self, state: _Copies, token: int, batch: dict[bytes, bytes],
                        size: int, ttl: float | None) -> None:
        """The copy, less the keys a write or delete overtook since the read started
        (checked here, with nothing awaited until near has the copy: a write sent after
        this check reaches near after the copy, and wins)."""
        try:
            fresh = {k: v for k, v in batch.items() if not state.overtaken(token, k)}
        finally:
            state.close_read(token)
        count("tier_near_dropped", len(batch) - len(fresh))
        batch = fresh
        try:
            if not batch:
                return
            result = await self.near.write(batch, ttl)
        except Exception as exc:  # ConfigError, or a bug: a copy must never raise
            count("tier_copy_failed", len(batch))
            state.trouble()
            self._warn("copy", f"copying into near ({self.near.safe_url}) raised "
                       f"{type(exc).__name__}: {exc}")
            return
        finally:
            state.pending -= size
        count("tier_copies", result.written)
        self._near_outcome(state, result, "copy")
        count("tier_copy_failed", result.failed_keys)
        if result.written:
            await self._undo_overtaken(batch)

    async def _undo_overtaken(self, batch: dict[bytes, bytes]) -> None:
        """Ask far again for what was just copied, and delete from near each copy far no
        longer holds the same value for: another process on this machine (sharing near)
        wrote or deleted the key while this read was under way, which `_Copies` cannot
        see. Writers write far first, then near (`_write`), so either that write reached
        near after this copy (and replaced it), or far answers this check with the new
        value (and the copy is deleted): a copy never stays over a newer write. Costs one
        far read of the copied keys (once per key per machine: a copy is made only when
        near lacks the key). Never raises."""
        keys = list(batch)
        try:
            now = await self.far.read(keys)
            stale = [k for k, v in zip(keys, now.values) if v != batch[k]]
            if stale:
                count("tier_copies_undone", len(stale))
                await self.near.delete_many(stale)
        except Exception as exc:  # StoreError, or a bug: a copy must never raise
            count("tier_copy_failed", len(keys))
            state = self._state()
            state.trouble()
            self._warn("undo", f"checking copies into near ({self.near.safe_url}) against "
                       f"far raised {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                await self.near.delete_many(keys)  # unchecked copies: never trusted

    def _near_outcome(self, state: _Copies, result: WriteResult, what: str) -> None:
        """Refusals (near full) and failures of a write into near: counted, near paused."""
        if result.rejected:
            count("tier_near_refused", len(result.rejected))
            self._warn("refused", f"near ({self.near.safe_url}) refused values ({what}): "
                       f"{next(iter(result.rejected.values()))}; they are served from far "
                       "and not kept on this machine: give near more room (LMDB map_size, "
                       "Valkey maxmemory with an eviction policy) or flush it")
        if result.rejected or result.failures:
            state.trouble()
        elif result.written:
            state.fine()

    def _warn(self, kind: str, message: str) -> None:
        """Log ``message`` once per process and kind (the counters keep the totals)."""
        if kind in self._warned:
            logger.debug("asynccache: %s", message)
            return
        self._warned.add(kind)
        logger.warning("asynccache: %s (counted in stats() as tier_*; logged once)", message)

    # -- writes -------------------------------------------------------------------------------
    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        """Far and near at once. The result is far's (what was written, dropped, refused),
        with near's node failures added (the cache counts and backs them off); near's
        refusals are counted apart (``tier_near_refused``): the value is in far."""
        if not entries:
            return WriteResult()
        state = self._state()
        with state.writes(entries):
            return await self._write(state, entries, ttl, skip)

    async def _write(self, state: _Copies, entries: Mapping[bytes, bytes], ttl: float | None,
                     skip: Collection[NodeName]) -> WriteResult:
        if state.paused():
            count("tier_near_dropped", len(entries))
            far = await self.far.write(entries, ttl, skip)  # far first (see below)
            forgot = await self._forget_near(list(entries), skip)
            far.failures = {**forgot, **far.failures}
            return far
        # far first, then near: a copy another process on this machine makes meanwhile
        # either lands in near before this write (which replaces it) or is checked
        # against far after this write reached it (see `_undo_overtaken`)
        far = await self.far.write(entries, ttl, skip)
        near = await self.near.write(entries, ttl, skip)
        self._near_outcome(state, near, "write")
        forgot = await self._forget_near(list(near.rejected), skip) if near.rejected else {}
        return WriteResult(written=far.written,
                           failures={**forgot, **near.failures, **far.failures},
                           failed_keys=far.failed_keys, rejected=dict(far.rejected),
                           answered=[*near.answered, *far.answered], skipped=far.skipped)

    async def _forget_near(self, keys: list[bytes], skip: Collection[NodeName]
                           ) -> dict[NodeName, StoreError]:
        """Delete from near the keys of a write it did not take (refused, or near paused):
        the value it may still hold under them is older than the one just written to far,
        and a near hit would serve it after the write (read your writes). One delete, which
        a full store still takes (it frees room). Never raises: a near backing off is not
        asked (it keeps what it holds, as any node that missed a write), and a failure is
        near's node's (so that the cache backs it off, as for a write)."""
        nodes = self.near.node_names
        if set(nodes) & set(skip):
            return {}
        try:
            await self.near.delete_many(keys)
        except Exception as exc:  # StoreError, or a bug: a write must not raise for near
            self._warn("forget", f"deleting values near ({self.near.safe_url}) did not take "
                       f"raised {type(exc).__name__}: {exc}")
            if isinstance(exc, StoreError) and len(nodes) == 1:
                return {nodes[0]: exc}
        return {}

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        """Far only: a lease must be one every machine sees."""
        return await self.far.add_many(entries, ttl)

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        """From both tiers; raises the first failure (far's first) once both were tried."""
        outcomes: list[BaseException | None] = []
        with self._state().writes(keys):
            for delete in (self.far.delete_many, self.near.delete_many):  # far first: _write
                try:
                    await delete(keys)
                    outcomes.append(None)
                except Exception as exc:
                    outcomes.append(exc)
        for outcome in outcomes:
            if outcome is not None:
                raise outcome

    # -- administration -----------------------------------------------------------------------
    async def ping(self) -> None:
        await self.far.ping()
        await self.near.ping()

    async def server_info(self) -> dict[str, Any]:
        """``max_value_size``, ``nodes`` (each with its ``tier``), and each tier's own
        answer under ``near`` and ``far``."""
        info: dict[str, Any] = {"max_value_size": self.max_value_size, "nodes": {}}
        for tier, client in (("near", self.near), ("far", self.far)):
            own = await client.server_info()
            info[tier] = own
            nodes = own.get("nodes") or {client.safe_url: {
                "server": own.get("provider") or client.scheme, "version": own.get("version")}}
            for name, node in nodes.items():
                info["nodes"][name] = {**node, "tier": tier}
        return info

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        """Near's keys, then far's: a key both hold is listed twice (like a key ``SCAN``
        lists twice, which every caller already allows for)."""
        async for page in self.near.scan(prefix, batch):
            yield page
        async for page in self.far.scan(prefix, batch):
            yield page

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Held by near or by far (what a read would find). Near's trouble: far is asked
        for every key."""
        there = await _near_answer(self.near.contains_many(keys), [False] * len(keys))
        rest = [i for i, held in enumerate(there) if not held]
        if rest:
            for i, held in zip(rest, await self.far.contains_many([keys[i] for i in rest])):
                there[i] = held
        return there

    async def sizes_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """Near's size where near holds the key, else far's."""
        sizes = await _near_answer(self.near.sizes_many(keys), [None] * len(keys))
        rest = [i for i, size in enumerate(sizes) if size is None]
        if rest:
            for i, size in zip(rest, await self.far.sizes_many([keys[i] for i in rest])):
                sizes[i] = size
        return sizes


async def _near_answer(asking: Any, otherwise: list[Any]) -> list[Any]:
    """Near's answer, or ``otherwise`` (ask far) when near is in trouble."""
    try:
        return list(await asking)
    except StoreError:
        return otherwise
