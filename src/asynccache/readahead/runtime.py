"""What a pipe or a node holds per process: the loop thread, the cache, the write queue.

Never pickled, rebuilt in every process that uses its owner (a forked DataLoader worker
inherits the parent's runtime object but not its thread or sockets: see ``current()``).
Both integrations compute misses through the same `CachePort.compute()`, so
write-back, its visibility guarantee and leases behave the same in both.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _fork
from ..cache.port import CachePort, CacheSettings, SettingsView
from ..observe.board import REPORT_INTERVAL, StatsBoard
from ..observe.histogram import Latency, merge
from ..observe.stats import with_hit_rate
from ..store.loop import LoopThread, get_loop_thread
from .readers import L1Reader, LoopReader, Reader, SocketReader

__all__ = ["JobStats", "ProcessRuntime", "UsesCacheSettings", "deep_copy_as_new"]

_Owner = TypeVar("_Owner")


class JobStats:
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
        local = (runtime.port.latency() if runtime is not None and runtime.current()
                 else merge([]))
        if per_process:
            return {os.getpid(): local, **self.latency_others()}
        return merge([local, *self.latency_others().values()])


class UsesCacheSettings(SettingsView):
    """What a pipe and a node share as owners of a cache: what they say of it (a
    `SettingsView` of their `CacheSettings`), and what a deep copy of them is."""

    settings: CacheSettings

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A deep copy is a new pipeline: its own namespace when unnamed, its own stats
        (see `deep_copy_as_new`); pickled copies still share both."""
        return deep_copy_as_new(self, memo)


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
    settings: CacheSettings = clone.settings  # type: ignore[attr-defined]
    clone.settings = dataclasses.replace(  # type: ignore[attr-defined]
        settings, keyspace=settings.keyspace.renewed())
    reports = JobStats(secrets.token_hex(8), clone.settings.keyspace.namespace)  # type: ignore[attr-defined]
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

    def __init__(self, settings: CacheSettings, reports: JobStats | None = None,
                 snapshot: Callable[[], dict[str, int]] | None = None) -> None:
        self.fork_generation = _fork.generation
        #: what the cache is built from (the client, the keyspace, the codec, ...)
        self.settings = settings
        client = self.client = settings.client
        self.loop: LoopThread = get_loop_thread()
        #: the cache, as this process's consumer threads use it
        self.port = CachePort(self.loop, settings)
        if reports is not None:  # log each kind of failure once per job, not per worker
            self.port.policy.log.claim = reports.board.claim
        self.lock = threading.Lock()
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
                    for kind, histogram in self.port.latency().items()} if latency else None)
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
            reader = SocketReader(self.port, reads, self.loop)
        else:
            reader = LoopReader(self.port, self.loop, wait_timeout=self.client.timeout * 2 + 0.5)
        return L1Reader(reader, self.port) if self.port.has_l1 else reader

    # -- the end ---------------------------------------------------------------------
    def flush(self, timeout: float) -> None:
        """Wait until queued writes are in the store (bounded); never raises for it."""
        if self.current():
            self.port.finish(close=False, timeout=timeout)

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

        async def cancel_readers() -> None:
            for reader in readers or []:
                await reader.cancel_pending()

        self.port.finish(close=close, timeout=timeout, before=cancel_readers if close else None)
