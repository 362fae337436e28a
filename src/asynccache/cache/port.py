"""The cache as read-ahead uses it: the one interface between `readahead/` and `cache/`.

The consumer threads of a pipe or a node (a DataLoader worker's, a training loop's) read,
decode, compute and write through one `CachePort`; the store steps run in the
process's loop thread, each bounded, so a consumer never waits on the store for longer
than a request's timeout allows. Misses are computed in the calling thread and written
back behind (`CachePort.compute()`), under the cache's one lease protocol when ``lease=``
is set. The module also names what else read-ahead needs of this layer (markers, the
key scheme, the settings' checks), so that `readahead/` imports from `cache/` this module
alone.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from ..errors import CacheError, StoreError, StoreTimeout
from ..observe.histogram import Latency
from ..store.loop import LoopThread
from .chunks import chunk_keys_of
from .codec import ChunkManifest, Codec
from .core import AsyncKVCache, OnError
from .expiry import check_ttl
from .keys import Keyspace, anonymous_scope, unique_namespace
from .leases import Claim, Leased, WaitFor, lease_protocol
from .markers import MISSING, NOT_READ, Failed, is_value
from .settings import CacheSettings, SettingsView

__all__ = ["MISSING", "NOT_READ", "CachePort", "CacheSettings", "ChunkManifest", "Codec",
           "Failed", "Keyspace", "OnError", "SettingsView", "Visible", "anonymous_scope",
           "check_ttl", "chunk_keys_of", "is_value", "unique_namespace"]

#: When a batch's computed values must be in the store (see `CachePort.compute()`)
Visible = Literal["queued", "now", "next"]


class CachePort:
    """One cache (`AsyncKVCache`) as the consumer threads of one pipe or node, in one
    process, use it; its async parts run in ``loop``.

    Reading: `decode()` a reply read on the consumer's own sockets, `assemble()` chunked
    values, `read()` in the loop, `from_l1()`, `copy_of()`, `read_own_writes()` for a miss this
    process wrote. Computing and writing: `compute()` (leases inside), `encode()`,
    `queue_writes()`, `wait_for_writes()`, `flush()`, `finish()`. Counting: `counters`,
    `histograms`, `policy`, `count()`, `counts()`, `latency()`."""

    def __init__(self, loop: LoopThread, settings: CacheSettings) -> None:
        self.loop = loop
        self.client = settings.client
        self.cache = AsyncKVCache.from_settings(settings)
        parts = self.cache.parts
        self.reads = self.cache.reads
        self.writer = self.cache.writer
        self.counters = parts.counters
        self.histograms = parts.histograms
        self.policy = parts.policy
        self.lease = parts.lease
        #: an in-process tier sits in front of the store (a reader asks it first)
        self.has_l1 = parts.l1 is not None
        #: a batch's writes were queued with visible="next" and not waited for yet
        self.writes_pending = False

    # -- reading -----------------------------------------------------------------------
    def decode(self, store_keys: Sequence[bytes], blobs: Sequence[Any], owned: bool = False
               ) -> tuple[list[Any], dict[int, ChunkManifest], int, int]:
        """One multi-get reply decoded (see `ReadPath.decode()`); any thread."""
        return self.reads.decode(store_keys, blobs, owned=owned)

    def assemble(self, store_keys: Sequence[bytes], manifests: Mapping[int, ChunkManifest],
                 out: list[Any], blobs: Sequence[Any]) -> None:
        """Chunked values joined once their chunks were read (see `ReadPath.assemble()`)."""
        self.reads.assemble(store_keys, manifests, out, blobs)

    def read(self, store_keys: Sequence[bytes], sizes: list[tuple[int, int]] | None = None
             ) -> Awaitable[tuple[list[Any], StoreError | None]]:
        """The whole read path, in the loop (see `ReadPath.values()`)."""
        return self.reads.values(store_keys, sizes)

    def from_l1(self, store_keys: Sequence[bytes]) -> tuple[list[Any], list[int]]:
        """What the L1 tier holds (see `ReadPath.from_l1()`); any thread."""
        return self.reads.from_l1(store_keys)

    def copy_of(self, store_key: bytes, value: Any) -> Any:
        """An object of its own with ``value``'s content (a key read twice)."""
        return self.reads.copy_of(store_key, value)

    def encode(self, values: Mapping[bytes, Any]) -> dict[bytes, bytes]:
        """``{store key: blob}`` for computed values; any thread."""
        return self.writer.encode_values(values)

    # -- counting ----------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    def counts(self) -> dict[str, int]:
        return self.cache.counts()

    def latency(self) -> dict[str, Latency]:
        return self.cache.latency()

    # -- misses ------------------------------------------------------------------------
    def compute(self, wanted: Mapping[bytes, Any], fn: Callable[[Any], Any], *,
                visible: Visible = "queued") -> dict[bytes, Any]:
        """Values for store keys that missed (``{store key: item}``), ``fn(item)`` each,
        computed in the calling thread and written back (queued: write-behind).

        ``visible`` says when the writes must be in the store:

        * ``"queued"`` -- whenever the writer gets to them (``flush()`` waits);
        * ``"now"`` -- before this call returns (about one round trip);
        * ``"next"`` -- before the *next* batch returns (see `wait_for_writes()`): a batch's
          writes go out while the worker computes the next one, instead of the worker
          waiting for them. The batch that ends a worker's planned epoch uses ``"now"``,
          so that every value written in epoch 1 is there for every worker in epoch 2,
          persistent or not.

        Under ``lease`` each key is computed by one process and written at once (see
        `AsyncKVCache`).

        Read your writes: a key this process wrote lately is not computed again (see
        `read_own_writes()`); every value returned is an object of its own.
        """
        found = self.read_own_writes(wanted)
        if found:
            wanted = {key: item for key, item in wanted.items() if key not in found}
        if self.lease is not None:
            computed = self._compute_once(wanted, fn) if wanted else {}
            computed.update(found)
            return computed
        computed = {key: fn(item) for key, item in wanted.items()}
        self.count("computed", len(computed))
        blobs = self.encode(computed)
        computed.update(found)
        if visible == "next":
            self.wait_for_writes()  # the previous batch's writes: long done by now, normally
            self.queue_writes(blobs)
            self.writes_pending = True
            return computed
        self.queue_writes(blobs)
        if visible == "now":
            self.wait_for_writes(force=True)
        return computed

    def read_own_writes(self, keys: Iterable[bytes]) -> dict[bytes, Any]:
        """Values of keys that missed but that this process wrote lately: from the write
        queue while the store has not acknowledged them (decoded afresh), else read again
        from the store (a read-ahead miss may predate the write). Only misses ask."""
        found, again, kept = self.writer.own_writes(list(keys))
        recalled = len(found)  # answered from this process's record
        if kept:  # values the store never took (dropped, failed): it gets them again now
            self.queue_writes(kept)
        if again:
            try:
                # a second look: damaged bytes were counted by the read that missed
                values, _error = self.loop.call(
                    self.reads.values(again, reread=True), self.client.timeout * 2 + 1)
            except (concurrent.futures.TimeoutError, CacheError):
                values = []
            found.update({key: value for key, value in zip(again, values) if is_value(value)})
        if found:  # counted as misses by the read: each is what it was instead
            counters = self.counters.shard()
            counters["recalled"] += recalled
            counters["hits"] += len(found) - recalled  # the store had them after all
            counters["misses"] -= len(found)
        return found

    def wait_for_writes(self, force: bool = False) -> None:
        """Wait for the writes of batches written with ``visible="next"`` (``force``:
        for everything queued); bounded, never raises."""
        if force or self.writes_pending:
            self.writes_pending = False
            self.flush(timeout=max(self.client.timeout * 2, 1.0))

    def _compute_once(self, wanted: Mapping[bytes, Any],
                      fn: Callable[[Any], Any]) -> dict[bytes, Any]:
        """The cache's one lease protocol (`lease_protocol`), driven from the calling
        thread: each store step runs in the loop, bounded; a step that does not end in
        time means "compute here" (the lease only saves work)."""
        cache, loop = self.cache, self.loop
        # requests of at most `timeout` each: a claim is add + read (+ chunks) + delete;
        # a wait's last poll, after its deadline, is a read (+ chunks) and a claim
        request = self.client.timeout
        wait_bound = (self.lease or 0.0) + self.client.expiry_slack + request * 6 + 1
        steps = lease_protocol(list(wanted))
        reply: Any = None
        while True:
            try:
                step = steps.send(reply)
            except StopIteration as end:
                outcome: Leased = end.value
                return {**outcome.computed, **outcome.found}
            if type(step) is Claim:
                try:
                    reply = loop.call(cache.leases.claim(step.keys), request * 4 + 1)
                except concurrent.futures.TimeoutError:
                    reply = {}, step.keys, []
            elif type(step) is WaitFor:
                try:
                    reply = loop.call(cache.leases.wait_for_values(step.keys), wait_bound)
                except concurrent.futures.TimeoutError:
                    reply = {}, step.keys
            else:
                reply = self._compute_mine({k: wanted[k] for k in step.keys}, fn)

    def _compute_mine(self, wanted: Mapping[bytes, Any],
                      fn: Callable[[Any], Any]) -> dict[bytes, Any]:
        if not wanted:
            return {}
        try:
            computed = {key: fn(item) for key, item in wanted.items()}
        except BaseException as exc:
            self._release_failed(list(wanted), exc)
            raise
        self.count("computed", len(computed))
        writer = self.writer
        blobs = self.encode(computed)
        entries = writer.entries_for(blobs)
        written = False
        try:
            written = self.loop.call(self._write_then_release(entries, list(computed)),
                                     self.client.timeout * 3 + 1)
        except concurrent.futures.TimeoutError:
            self.count("writes_dropped", len(entries))
        finally:
            if not written:  # read your writes: what was returned is what is read again
                self.cache.writes.keep(blobs)
                writer.count_forgotten()
        return computed

    def _release_failed(self, keys: list[bytes], exc: BaseException) -> None:
        """A compute raised while this process held the leases of ``keys``: drop them
        now, or every retry (here, or in another process) waits the lease out. After an
        ordinary exception the release is waited for (bounded by one request), so this
        process's retry finds the leases free; after an interrupt (KeyboardInterrupt,
        SystemExit) it is only scheduled, so the interrupt is not delayed."""
        release = self.cache.leases.release(keys)
        if not isinstance(exc, Exception):
            self.loop.submit(release)
            return
        try:
            self.loop.call(release, self.client.timeout + 1)
        except concurrent.futures.TimeoutError:
            pass  # the leases expire on their own; the compute's error matters more

    async def _write_then_release(self, entries: dict[bytes, bytes], keys: list[bytes]) -> bool:
        """Write computed values now, then drop their leases (waiters see the value);
        True when every value was written."""
        written = False
        try:
            written = await self.cache.write_entries(entries)
        except StoreError:
            pass  # raise mode: counted by the policy; write-back never raises
        finally:  # cancelled too (an interrupted caller): never leave the lease held
            await self.cache.leases.release(keys)
        return written

    # -- writes ------------------------------------------------------------------------
    def queue_writes(self, blobs: Mapping[bytes, bytes]) -> None:
        """Write encoded values behind (``{store key: blob}``); any thread."""
        if self.writer.write_later(blobs):
            self.loop.call_soon(self.writer.start)

    def flush(self, timeout: float) -> None:
        """Wait until queued writes are in the store (bounded); never raises for it."""
        self.finish(close=False, timeout=timeout)

    def finish(self, *, close: bool, timeout: float,
               before: Callable[[], Awaitable[None]] | None = None) -> None:
        """Write what is queued; with ``close`` also close the cache (nothing of it asks
        the store again) after ``before()`` (in the loop: the read-ahead's own end).
        Bounded by ``timeout``; never raises for the store."""
        if self.loop.closed:
            return
        try:
            self.loop.call(self._finish(close, before), timeout)
        except (TimeoutError, StoreError) as exc:
            left = len(self.cache.writes)
            self.count("writes_dropped", left)
            if isinstance(exc, TimeoutError):  # says nothing by itself: say what happened
                exc = StoreTimeout(
                    f"{left:,} queued writes were not all in the store after the "
                    f"{'close' if close else 'flush'}'s timeout={timeout:g}s; those left are "
                    f"dropped (whoever misses them computes them again): on a slow link, "
                    f"pass a larger timeout= to close() or flush()")
            self.policy.log.report("flush", exc, self.client.safe_url)

    async def _finish(self, close: bool,
                      before: Callable[[], Awaitable[None]] | None) -> None:
        if before is not None:
            await before()
        if close:  # closed too: nothing of the cache asks the store again (probes, refills)
            await self.cache.aclose()
        else:
            await self.cache.flush()
