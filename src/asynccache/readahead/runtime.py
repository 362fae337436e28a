"""What a pipe or a node holds per process: the loop thread, the cache, the write queue.

Never pickled, rebuilt in every process that uses its owner (a forked DataLoader worker
inherits the parent's runtime object but not its thread or sockets: see ``current()``).
Both integrations compute misses through `ProcessRuntime.compute()`, so write-back,
its visibility guarantee and leases behave the same in both.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .. import _fork
from ..cache.codec import Codec
from ..cache.core import AsyncKVCache, OnError
from ..cache.keys import Keyspace
from ..cache.leases import Claim, Leased, WaitFor, lease_protocol
from ..cache.markers import is_value
from ..errors import CacheError, StoreError, StoreTimeout
from ..observe.board import REPORT_INTERVAL, StatsBoard
from ..observe.histogram import Latency, merge
from ..observe.stats import with_hit_rate
from ..store.api import BaseClient
from ..store.loop import LoopThread, get_loop_thread
from .readers import L1Reader, LoopReader, Reader, SocketReader

__all__ = ["ProcessRuntime", "Reports", "deep_copy_as_new"]

_Owner = TypeVar("_Owner")


class Reports:
    """The stats board of one pipe or node, as seen from its owner (the process that
    built it) and from its copies (DataLoader workers), which publish to it."""

    def __init__(self, board_id: str, namespace: str | None = None) -> None:
        self.board = StatsBoard(board_id)
        self.owner_pid = os.getpid()
        self.namespace = namespace

    def bind(self, owner: object) -> None:
        """Owner side: sweep old boards; label this one with the namespace (what
        ``asynccache stats`` looks for); remove it when ``owner`` is let go of."""
        self.board.sweep()
        with contextlib.suppress(OSError):
            self.board.label(self.namespace)
        weakref.finalize(owner, _remove_if_owner, self.board, _fork.generation)

    def publish(self, counters: dict[str, int],
                latency: dict[str, list[int]] | None = None) -> None:
        """Write this process's counters (and request histograms), only while its board
        exists (once removed, a late report must not bring it back)."""
        self.board.publish(counters)
        if latency is not None:
            self.board.publish_latency(latency)

    @property
    def owner(self) -> bool:
        return os.getpid() == self.owner_pid

    def others(self) -> dict[int, dict[str, int]]:
        """What the copies in other processes last published (owner side)."""
        return self.board.collect() if self.owner else {}

    def stats(self, local: dict[str, int], per_process: bool) -> Any:
        """The public ``stats()`` of a pipe or node: ``local`` (this process's counters)
        summed with its copies', or by pid with ``per_process``; with ``hit_rate``."""
        if per_process:
            return {pid: with_hit_rate(counts) for pid, counts in
                    {os.getpid(): local, **self.others()}.items()}
        return with_hit_rate(self.total(local))

    def total(self, local: dict[str, int]) -> dict[str, int]:
        total = dict(local)
        for counters in self.others().values():
            for name, value in counters.items():
                total[name] = total.get(name, 0) + value
        return total

    def latency_others(self) -> dict[int, dict[str, Latency]]:
        """The latency histograms the copies in other processes last published."""
        if not self.owner:
            return {}
        found = {}
        for pid, rows in self.board.collect_latency().items():
            try:
                found[pid] = {kind: Latency.from_row(row) for kind, row in rows.items()}
            except ValueError:
                continue  # written by another asynccache version: skip, never fail
        return found

    def latency(self, runtime: ProcessRuntime | None, per_process: bool) -> Any:
        """What ``latency()`` of a pipe or node returns: this process's histograms (its
        runtime's, if live here) and the copies', summed or by pid."""
        local = (runtime.cache.latency() if runtime is not None and runtime.current()
                 else merge([]))
        if per_process:
            return {os.getpid(): local, **self.latency_others()}
        return merge([local, *self.latency_others().values()])


def deep_copy_as_new(owner: _Owner, memo: dict[int, Any]) -> _Owner:
    """``copy.deepcopy`` of a pipe or node: a new pipeline, not another view of this one.

    Pickling (DataLoader workers, epochs) keeps the namespace and the stats board: the
    copies are the same pipeline. A deep copy is what a user makes to build another one
    (``val = deepcopy(train)``, then another transform): without ``namespace=`` it draws
    a namespace of its own, so it never reads the original's values, and it always gets
    a stats board of its own (its counters are not the original's). State is copied
    through the owner's ``__getstate__``, as pickling does (no runtime, no sockets).
    """
    state: dict[str, Any] = owner.__getstate__()  # type: ignore[assignment]
    state = {name: value for name, value in state.items() if name != "_reports"}
    clone = object.__new__(type(owner))
    memo[id(owner)] = clone
    clone.__dict__.update(copy.deepcopy(state, memo))
    keyspace: Keyspace = clone.keyspace  # type: ignore[attr-defined]
    clone.keyspace = keyspace.renewed()  # type: ignore[attr-defined]
    clone.namespace = clone.keyspace.namespace  # type: ignore[attr-defined]
    reports = Reports(secrets.token_hex(8), clone.namespace)  # type: ignore[attr-defined]
    clone._reports = reports  # type: ignore[attr-defined]
    reports.bind(clone)
    return clone


def _report_weakly(ref: weakref.ref[ProcessRuntime]) -> None:
    runtime = ref()
    if runtime is not None:
        runtime._report()


def _remove_if_owner(board: StatsBoard, generation: int) -> None:
    if _fork.generation == generation:  # a forked child inherits this finalizer: not its board
        board.remove()


class ProcessRuntime:
    """Loop thread, cache and queued writes of one pipe or node in one process."""

    def __init__(self, client: BaseClient[Any], keyspace: Keyspace, ttl: Any,
                 codec: Codec | None, on_error: OnError, lease: Any,
                 reports: Reports | None = None, l1_bytes: int | None = None,
                 snapshot: Callable[[], dict[str, int]] | None = None) -> None:
        self.fork_generation = _fork.generation
        self.client = client
        self.loop: LoopThread = get_loop_thread()
        self.cache = AsyncKVCache(client, keyspace, ttl, codec, on_error, lease=lease,
                                  l1_bytes=l1_bytes)
        if reports is not None:  # log each kind of failure once per job, not per worker
            self.cache.policy.log.claim = reports.board.claim
        self.lease = self.cache.lease
        self.lock = threading.Lock()
        #: a batch's writes were queued with visible="next" and not waited for yet
        self.unsettled = False
        self.loop.call_soon(client.retain)
        #: every copy publishes its counters every second (a DataLoader worker's pipe also
        #: with each batch): those in workers for the owner's stats(), the owner's own for
        #: a process outside the job (``asynccache stats``); stats() skips its own file
        self.reports = reports
        self._snapshot = snapshot
        self._timer: Any = None
        #: one publisher at a time (the loop thread's timer, a worker's batch): both write
        #: the same counts file
        self._publishing = threading.Lock()
        if self.reports is not None and snapshot is not None:
            self.loop.call_soon(self._report_later)

    # -- reports (loop thread) -----------------------------------------------------------
    def _report_later(self) -> None:
        # a weak reference: the timer must not keep a pipe nobody uses alive
        self._timer = self.loop.loop.call_later(REPORT_INTERVAL, _report_weakly,
                                                weakref.ref(self))

    def _report(self) -> None:
        self.publish()
        if not self.loop.closed:
            self._report_later()

    def publish(self, latency: bool = True) -> None:
        """Write this process's counters (and, with ``latency``, its request histograms)
        to the board. A DataLoader worker calls it (without latency) before it hands each
        batch over: once the training loop has received a batch, the owner's ``stats()``
        counts its reads (~15 µs a batch: see `asynccache.observe.counts_file`)."""
        if self.reports is None or self._snapshot is None:
            return
        with self._publishing:
            try:
                self.reports.publish(self._snapshot(), {
                    kind: histogram.to_row()
                    for kind, histogram in self.cache.latency().items()} if latency else None)
            except OSError:
                pass  # a full or read-only /dev/shm costs the cross-process view, nothing else

    def current(self) -> bool:
        """False in a forked child: this runtime (loop, sockets) is the parent's."""
        return self.fork_generation == _fork.generation

    def new_reader(self) -> Reader:
        """Read-ahead I/O for the calling thread: its own sockets when the store offers
        them, else the loop thread. Never for the loop thread itself: a blocking read
        there would stall (or, through the loop, deadlock) every pipe of the process."""
        self.loop.check_caller()
        reads = self.client.consumer_reads()
        reader: Reader
        if reads is not None:
            reader = SocketReader(self.cache, reads, self.loop)
        else:
            reader = LoopReader(self.cache, self.loop, wait_timeout=self.client.timeout * 2 + 0.5)
        return L1Reader(reader, self.cache) if self.cache.l1 is not None else reader

    # -- misses ------------------------------------------------------------------------
    def compute(self, wanted: Mapping[bytes, Any], fn: Callable[[Any], Any], *,
                visible: str = "queued") -> dict[bytes, Any]:
        """Values for store keys that missed (``{store key: item}``), ``fn(item)`` each,
        computed in the calling thread and written back (queued: write-behind).

        ``visible`` says when the writes must be in the store:

        * ``"queued"`` -- whenever the writer gets to them (``flush()`` waits);
        * ``"now"`` -- before this call returns (about one round trip);
        * ``"next"`` -- before the *next* batch returns (see `settle()`): a batch's
          writes go out while the worker computes the next one, instead of the worker
          waiting for them. The batch that ends a worker's planned epoch uses ``"now"``,
          so that every value written in epoch 1 is there for every worker in epoch 2,
          persistent or not.

        Under ``lease`` each key is computed by one process and written at once (see
        `AsyncKVCache`).

        Read your writes: a key this process wrote lately is not computed again (see
        `recall()`); every value returned is an object of its own.
        """
        found = self.recall(wanted)
        if found:
            wanted = {key: item for key, item in wanted.items() if key not in found}
        if self.lease is not None:
            computed = self._compute_once(wanted, fn) if wanted else {}
            computed.update(found)
            return computed
        computed = {key: fn(item) for key, item in wanted.items()}
        self.cache.counters.add("computed", len(computed))
        blobs = self.cache.writer.encode_values(computed)
        computed.update(found)
        if visible == "next":
            self.settle()  # the previous batch's writes: long done by now, normally
            self.queue_writes(blobs)
            self.unsettled = True
            return computed
        self.queue_writes(blobs)
        if visible == "now":
            self.settle(force=True)
        return computed

    def recall(self, keys: Iterable[bytes]) -> dict[bytes, Any]:
        """Values of keys that missed but that this process wrote lately: from the write
        queue while the store has not acknowledged them (decoded afresh), else read again
        from the store (a read-ahead miss may predate the write). Only misses ask."""
        found, again, kept = self.cache.writer.recall(list(keys))
        recalled = len(found)  # answered from this process's record
        if kept:  # values the store never took (dropped, failed): it gets them again now
            self.queue_writes(kept)
        if again:
            try:
                # a second look: damaged bytes were counted by the read that missed
                values, _error = self.loop.call(
                    self.cache.reads.values(again, second_look=True), self.client.timeout * 2 + 1)
            except (concurrent.futures.TimeoutError, CacheError):
                values = []
            reread = {key: value for key, value in zip(again, values) if is_value(value)}
            found.update(reread)
        if found:  # counted as misses by the read: each is what it was instead
            counters = self.cache.counters.shard()
            counters["recalled"] += recalled
            counters["hits"] += len(found) - recalled  # the store had them after all
            counters["misses"] -= len(found)
        return found

    def settle(self, force: bool = False) -> None:
        """Wait for the writes of batches written with ``visible="next"`` (``force``:
        for everything queued); bounded, never raises."""
        if force or self.unsettled:
            self.unsettled = False
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
        self.cache.counters.add("computed", len(computed))
        writer = self.cache.writer
        blobs = writer.encode_values(computed)
        entries = writer.entries_for(blobs)
        written = False
        try:
            written = self.loop.call(self._write_then_release(entries, list(computed)),
                                     self.client.timeout * 3 + 1)
        except concurrent.futures.TimeoutError:
            self.cache.count("writes_dropped", len(entries))
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
        if self.cache.writer.write_later(blobs):
            self.loop.call_soon(self.cache.writer.start)

    def flush(self, timeout: float) -> None:
        """Wait until queued writes are in the store (bounded); never raises for it."""
        self.finish(close=False, timeout=timeout)

    def finish(self, *, close: bool, timeout: float,
               readers: list[Reader] | None = None) -> None:
        """Write what is queued; with ``close`` also cancel the loop-side read-ahead of
        ``readers`` and close this loop's connections. Bounded by ``timeout``."""
        if not self.current() or self.loop.closed:
            return
        if close:
            if self._timer is not None:
                self.loop.call_soon(self._timer.cancel)
            self.publish()  # the final numbers of a copy (a worker that exits)
        try:
            self.loop.call(self._finish(close, readers or []), timeout)
        except (TimeoutError, StoreError) as exc:
            left = len(self.cache.writes)
            self.cache.count("writes_dropped", left)
            if isinstance(exc, TimeoutError):  # says nothing by itself: say what happened
                exc = StoreTimeout(
                    f"{left:,} queued writes were not all in the store after the "
                    f"{'close' if close else 'flush'}'s timeout={timeout:g}s; those left are "
                    f"dropped (whoever misses them computes them again): on a slow link, "
                    f"pass a larger timeout= to close() or flush()")
            self.cache.policy.log.report("flush", exc, self.client.safe_url)

    async def _finish(self, close: bool, readers: list[Reader]) -> None:
        if close:
            for reader in readers:
                await reader.cancel_pending()
        if close:  # closed too: nothing of the cache asks the store again (probes, refills)
            await self.cache.aclose()
        else:
            await self.cache.flush()
