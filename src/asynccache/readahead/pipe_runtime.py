"""The pipe's per-process runtime: the cache's port plus one prefetcher per thread.

What a pipe hands it is a `PipeShape` (its length, its read-ahead settings, the order to
follow), not the pipe: the pipe imports this module, never the other way round.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cache.port import CacheSettings
from ..errors import ConfigError
from .prefetch import Prefetcher
from .runtime import JobStats, ProcessRuntime
from .window import Budget

logger = logging.getLogger("asynccache")

__all__ = ["PipeRuntime", "PipeShape"]


@dataclass(frozen=True)
class PipeShape:
    """What a pipe's runtime needs of its pipe, taken when the runtime is built."""

    #: ``len(source)``
    length: int
    #: ``0 <= i < fast_length``: an int index needing no normalization (-1: keyed source)
    fast_length: int
    #: a keyed source (a mapping): no range of ints to read ahead in
    keyed: bool
    #: upcoming indices read ahead per thread (per node of a pool or cluster)
    prefetch: int
    #: the read-ahead's memory budget in this process, in bytes
    readahead_bytes: int
    #: the pipe's order, asked for by a prefetcher: its plan, and how to draw the next
    follow_order: Callable[[], tuple[list[Any], Callable[[Any], list[Any]]] | None]


class PipeRuntime(ProcessRuntime):
    """A pipe's runtime: the shared parts plus one prefetcher per consumer thread."""

    def __init__(self, settings: CacheSettings, reports: JobStats, shape: PipeShape) -> None:
        super().__init__(settings, reports, self.stats)
        self.shape = shape
        self.length = shape.length
        #: ``0 <= i < fast_length`` means "an int index needing no normalization"
        self.fast_length = shape.fast_length
        self.local = threading.local()
        #: the read-ahead's memory in this process, shared by the threads' windows
        self.budget = Budget(shape.readahead_bytes)
        #: every thread's prefetcher (for stats and close); ended threads' are folded
        self.prefetchers: list[tuple[weakref.ref[threading.Thread], Prefetcher]] = []
        self.retired = Prefetcher.zero_counts()
        #: the last pass over the order (its batches), and the DataLoader's batch size
        #: as the first __getitems__ showed it: what a worker's share is cut from
        self.drawn: list[Any] | None = None
        self.batch_size: int | None = None

    # -- per-thread read state -----------------------------------------------------------
    def prefetcher(self) -> Prefetcher:
        """This thread's prefetcher, made on its first read."""
        try:
            return self.local.prefetcher  # type: ignore[no-any-return]
        except AttributeError:
            return self._new_prefetcher()

    def order_changed(self) -> None:
        """Every thread's prefetcher re-plans from the pipe's order at its next read."""
        with self.lock:
            for _ref, p in self.prefetchers:
                p.stale_order = True

    def _new_prefetcher(self) -> Prefetcher:
        shape = self.shape
        reader = self.new_reader()
        length = None if shape.keyed else self.length
        # prefetch is per node: a batch spread over a cluster's or a pool's nodes keeps
        # each node's share as large as one server's (the bytes bound still holds)
        p = Prefetcher(reader, self.settings.keyspace.key, length,
                       shape.prefetch * reader.fanout, self.port.policy.strict, self.budget)
        p.follow_order = shape.follow_order
        p.on_stop = self._order_not_followed
        p.stale_order = True  # its first read follows the pipe's order
        self.local.prefetcher = p
        with self.lock:
            self._fold_ended()
            self.prefetchers.append((weakref.ref(threading.current_thread()), p))
        return p

    def warn_process_local(self) -> None:
        """A store whose values stay in one process, used in a DataLoader worker: say
        once per job that nothing is shared, and what shares."""
        if self.port.policy.log.first("workers", ConfigError("process-local store")):
            logger.warning(
                "asynccache: %s keeps its values in each process: the DataLoader workers "
                "of this pipe share nothing with each other or with the main process, and "
                "workers that are not persistent start empty every epoch. To share values "
                "across workers, epochs and jobs use lmdb:///path (one machine, no server) "
                "or a server (redis://, valkey://, memcached://).", self.client.safe_url)

    def _order_not_followed(self) -> None:
        """A prefetcher stopped guessing: say so once per job (the stats board's claim,
        as failures are logged), with the fix."""
        if self.port.policy.log.first("read-ahead", ConfigError("order not followed")):
            logger.warning(
                "asynccache: read-ahead stopped guessing: the reads do not come in the order "
                "given to set_order() (a sampler that draws from a random generator of its "
                "own?). Reads go on as one batched request per batch, nothing is wrong; to "
                "read ahead, pass the indices in the order they will be read "
                "(set_order(indices)) or a sampler with a seeded torch.Generator. Read-ahead "
                "resumes by itself once reads follow the order again; stats() counts the "
                "stops in 'readahead_stopped'.")

    def _fold_ended(self) -> None:
        """Keep the counters of threads that have ended, close their sockets (locked)."""
        live = []
        for ref, p in self.prefetchers:
            thread = ref()
            if thread is None or not thread.is_alive():
                for name, value in p.counts.items():
                    self.retired[name] += value
                p.close()
            else:
                live.append((ref, p))
        self.prefetchers = live

    def counts(self) -> dict[str, int]:
        with self.lock:
            self._fold_ended()
            total = dict(self.retired)
            for _ref, p in self.prefetchers:
                for name, value in p.counts.items():
                    total[name] += value
        return total

    def stats(self) -> dict[str, int]:
        """This process's counters: the cache's and every thread's prefetcher's."""
        total = self.port.counts()
        total.setdefault("computed", 0)
        for name, value in self.counts().items():
            total[name] = total.get(name, 0) + value
        return total

    def close(self, timeout: float) -> None:
        with self.lock:
            prefetchers = [p for _ref, p in self.prefetchers]
        for p in prefetchers:
            p.close()
        self.finish(close=True, timeout=timeout, readers=[p.reader for p in prefetchers])
