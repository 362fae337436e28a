"""Writes of a cache: now (`Writer.write_entries()`) or behind, through its one queue
(`asynccache.cache.write_queue`, which also keeps what this process wrote for reads of
its own writes).

Recovery. Kept values are what the store lacks: once it answers again (the failure
policy's `FailurePolicy.on_recovered`), `Writer.recover()` writes them again in the
background, a batch at a time through the queue (`WriteQueue.unstored()`); a value read
from the record is queued again too. A kept value whose write landed leaves the record
(after ``ACKED_KEEP_SECONDS``, as any acknowledged value). An acknowledged value that a
read misses ``REWRITE_AFTER`` seconds after its write landed was lost by the store (a
restart, an eviction): it is written again as well.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import DecodeError, StoreError, StoreTimeout
from ..store.api import STORE_COUNTS, NodeName, WriteResult
from . import chunks

if TYPE_CHECKING:
    from .parts import CacheParts

__all__ = ["WRITE_REQUEST_BYTES", "Writer"]

#: Bytes per write request: a request must fit in ``timeout`` (a 50 MB batch is not one
#: 1-second request), and reads queue behind less.
WRITE_REQUEST_BYTES = 8 * 1024 * 1024

#: A lone value this large that timed out may be too large for the link (the error says
#: so); a smaller one timing out means a slow or frozen store.
LARGE_ALONE = 256 * 1024


class Writer:
    """The writes of one cache, from its parts: values encoded (any thread), written now or
    queued behind (the cache's one `WriteQueue`, ``parts.writes``), counted, and read back
    from the queue on a miss."""

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts
        #: the store answered again after failing: how many of the record's values the
        #: store lacks the writer still writes again once its queue is empty (a bound: a
        #: value the store keeps refusing is not tried for ever; see `recover()`)
        self.recovering = 0
        #: the timer that tries the record's values again once a back-off ends
        self._probe: asyncio.TimerHandle | None = None
        parts.policy.on_recovered = self.recover

    # -- encoding: any thread ------------------------------------------------------------
    def encode_values(self, mapping: Mapping[bytes, Any]) -> dict[bytes, bytes]:
        """``{store key: blob}`` for ``{store key: value}``: each value encoded whole, bound
        to its key. Pure (no I/O, no loop state), so it may run in any thread. Raises
        `EncodeError` for the user to fix."""
        parts = self.parts
        encode = parts.codec.encode
        blobs = {store_key: encode(value, store_key) for store_key, value in mapping.items()}
        if parts.l1 is not None:
            for store_key, blob in blobs.items():
                parts.l1.put(store_key, blob)  # a computed item reused soon is an L1 hit
        return blobs

    def entries_for(self, blobs: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
        """Store-ready entries for encoded values, chunked where over the store's item
        limit (`asynccache.cache.chunks.split_entries()`)."""
        parts = self.parts
        entries, chunked = chunks.split_entries(blobs, parts.client.max_value_size,
                                                parts.codec, parts.chunking)
        if chunked:
            parts.counters.shard()["chunked_values"] += chunked
        return entries

    def encode_entries(self, mapping: Mapping[bytes, Any]) -> dict[bytes, bytes]:
        """Store-ready ``{store key: blob}`` for ``{store key: value}``, chunked if needed
        (`encode_values()` then `entries_for()`). Any thread."""
        return self.entries_for(self.encode_values(mapping))

    # -- now ------------------------------------------------------------------------------
    async def write_entries(self, entries: Mapping[bytes, bytes], ttl: float | None) -> bool:
        """Write encoded entries now, in requests of at most WRITE_REQUEST_BYTES.

        True when every entry was written; failures are counted, logged once and, in
        raise mode, raised (the first of them).
        """
        parts = self.parts
        client, policy = parts.client, parts.policy
        ok = True
        first_error: StoreError | None = None
        for part in _requests(entries, client.max_batch * 4):
            sent = time.perf_counter_ns()
            counts = STORE_COUNTS.set(parts.counters.add)  # the store's own counts: ours
            try:
                result = await client.write(part, ttl, policy.down())
            finally:
                STORE_COUNTS.reset(counts)
            if result.answered or result.failures or result.rejected:
                parts.histograms.record("write", time.perf_counter_ns() - sent)
            if not self._count(part, result):
                ok = False
                first_error = first_error or next(
                    iter((*result.failures.values(), *result.rejected.values())), None)
        if first_error is not None and policy.strict:
            raise first_error
        return ok

    def _count(self, part: Mapping[bytes, bytes], result: WriteResult) -> bool:
        parts = self.parts
        policy = parts.policy
        counters = parts.counters.shard()
        for node in result.answered:
            policy.succeeded(node)
        for node, exc in result.failures.items():
            size = len(next(iter(part.values()))) if len(part) == 1 else 0
            if isinstance(exc, StoreTimeout) and size >= LARGE_ALONE:
                # a value that alone may outlast the timeout on a slow link; a small one
                # timing out says the store is slow or frozen (the message already does)
                exc = result.failures[node] = StoreTimeout(  # logged, and raised
                    f"{exc} — this request was one value of {_size(size)}: at this link's "
                    f"speed it may need more than timeout={parts.client.timeout:g}s; raise "
                    "timeout= in connect(), or it is never cached")
            policy.failed(node, "set", exc)
        for _key, exc in result.rejected.items():
            policy.failed(NodeName(parts.client.safe_url), "set", exc)
        dropped = result.failed_keys + len(result.rejected) + result.skipped
        counters["writes_dropped"] += dropped
        if result.written:
            counters["sets"] += result.written
            counters["set_batches"] += 1
            counters["bytes_written"] += sum(len(v) for v in part.values())
        return dropped == 0

    # -- behind -----------------------------------------------------------------------------
    def write_later(self, blobs: Mapping[bytes, bytes]) -> bool:
        """Queue encoded values (``{store key: blob}``) for write-behind, from any thread.

        Until the store acknowledges them, `own_writes()` hands them back. True when
        the loop's writer must be started: call `start()` in the cache's loop
        (``loop.call_soon_threadsafe`` from another thread)."""
        parts = self.parts
        wake, dropped = parts.writes.put(blobs, self.entries_for(blobs))
        if dropped:
            parts.counters.shard()["writes_dropped"] += dropped
            self.count_forgotten()
        return wake

    def count_forgotten(self) -> None:
        """Count kept values forgotten past the budget (``writes_forgotten``)."""
        forgotten = self.parts.writes.take_forgotten()
        if forgotten:
            self.parts.counters.shard()["writes_forgotten"] += forgotten

    def start(self) -> None:
        """Start this loop's writer if entries are queued (or the record is to be written
        again) and none is at work (loop)."""
        parts = self.parts
        here = parts.loops.here()
        if (here.writer is None or here.writer.done()) and (
                len(parts.writes) or (self.recovering and parts.writes.unstored_values)):
            here.writer = here.spawn(self._drain())

    def recover(self) -> None:
        """A store node answered after failing: write the values this process keeps
        because the store lacks them, in the background (any thread: the policy calls it
        from whichever thread saw the answer)."""
        parts = self.parts
        if parts.loops.closed:  # done with the store: a write now would reopen its connections
            return
        self.recovering = parts.writes.unstored_values
        if not self.recovering:
            return
        here = parts.loops.last
        if here is None or here.loop.is_closed():
            return  # no loop yet: the next write starts the writer, which goes on with these
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is here.loop:
            self.start()
        else:
            here.loop.call_soon_threadsafe(self.start)

    async def _drain(self) -> None:
        parts = self.parts
        writes, max_keys = parts.writes, parts.client.max_batch * 4
        while True:
            batch = writes.take(max_keys)
            if batch is None:
                if not self._rewrite_next(max_keys):
                    return
                continue
            written = False
            try:
                written = await self.write_entries(batch.entries, parts.ttl)
            except StoreError:
                pass  # raise mode: counted by the policy; nobody waits on write-behind
            finally:
                writes.done(batch, written)
                if not written:
                    if parts.policy.down():
                        self.recovering = 0  # failing again: the next recovery goes on
                        self._probe_later()
                    self.count_forgotten()

    def _probe_later(self) -> None:
        """Once the back-off ends, try the values the store lacks again (loop): the
        probe that finds a store back even when no read asks it (every read a near hit,
        a process that only writes). Its success is a recovery (`recover()`); its
        failure backs the node off longer, and is probed again after that."""
        if self._probe is not None or not self.parts.writes.unstored_values:
            return
        delay = self.parts.policy.retry_in()
        if delay is None:
            return
        loop = asyncio.get_running_loop()
        self._probe = loop.call_later(delay + 0.01, _probe_weakly, weakref.ref(self))

    def probe(self) -> None:
        """The back-off ended: write the record's values again (loop)."""
        self._probe = None
        self.recover()  # (nothing for a closed cache)

    def _rewrite_next(self, max_keys: int) -> bool:
        """Queue the next batch of kept values the store lacks, while recovering and no
        node is backing off; False when there is none (the writer's turn ends)."""
        parts = self.parts
        if self.recovering <= 0:
            return False
        if parts.policy.down():  # some node still backing off: try when it ends
            self.recovering = 0
            self._probe_later()
            return False
        blobs = parts.writes.unstored(min(max_keys, self.recovering), WRITE_REQUEST_BYTES)
        if not blobs:
            self.recovering = 0
            return False
        self.recovering -= len(blobs)
        parts.counters.shard()["rewritten"] += len(blobs)
        self.write_later(blobs)
        return True

    async def flush(self) -> None:
        """Wait for queued write-behind entries to reach the store (or be dropped)."""
        parts = self.parts
        here = parts.loops.last
        if here is None or here.loop is not asyncio.get_running_loop():
            if not len(parts.writes):
                return
            here = parts.loops.here()
        self.start()
        while here.writer is not None and not here.writer.done():
            await asyncio.shield(here.writer)
            self.start()  # queued meanwhile by another thread

    def own_writes(self, store_keys: Sequence[bytes]
               ) -> tuple[dict[bytes, Any], list[bytes], dict[bytes, bytes]]:
        """For keys that missed: values this process wrote and the store has not
        acknowledged or never took (decoded afresh: an object of their own), the keys
        acknowledged lately, which the store now holds (read them again rather than
        compute them), and the blobs the store never took: the caller writes them again
        (`write_later()`), so that a store back from an outage gets them. Any thread;
        only misses ask. Counting the reads is the caller's (it knows what they were)."""
        parts = self.parts
        blobs, again, kept = parts.writes.own_writes(store_keys)
        found: dict[bytes, Any] = {}
        decode = parts.codec.decode
        for key, blob in itertools.chain(blobs.items(), kept.items()):
            try:
                found[key] = decode(blob, key)
            except DecodeError:  # bytes this process encoded: cannot happen; be safe
                again.append(key)
        return found, again, kept


def _probe_weakly(ref: weakref.ref[Writer]) -> None:
    # a weak reference: a pending probe must not keep a cache nobody uses alive
    writer = ref()
    if writer is not None:
        writer.probe()


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _requests(entries: Mapping[bytes, bytes], max_keys: int) -> Iterator[dict[bytes, bytes]]:
    """``entries`` cut into requests of at most ``max_keys`` keys and about
    WRITE_REQUEST_BYTES bytes (a larger single value is a request of its own)."""
    part: dict[bytes, bytes] = {}
    size = 0
    for key, blob in entries.items():
        n = len(blob)
        if part and (size + n > WRITE_REQUEST_BYTES or len(part) >= max_keys):
            yield part
            part, size = {}, 0
        part[key] = blob
        size += n
    if part:
        yield part
