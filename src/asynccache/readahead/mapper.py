"""``CachedMapper``: the cache as a ``torchdata.nodes`` node, where the order is known.

Why it is built this way: docs/design.md, "The node".
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal, TypeVar

from .. import _fork
from .._fork import park_inherited
from ..cache.port import (
    MISSING,
    NOT_READ,
    CacheSettings,
    Codec,
    Keyspace,
    OnError,
    anonymous_scope,
    unique_namespace,
)
from ..errors import ClosedError, ConfigError, MissingDependency
from ..observe.catalog import CACHE_COUNTERS, NODE_COUNTERS
from ..store.api import BaseClient
from .engine import NOTHING, ReadAhead
from .readers import Reader, Ticket
from .runtime import JobStats, ProcessRuntime, UsesCacheSettings
from .window import WINDOW_GROWTH, WindowSizer, readahead_budget

try:
    from torch.utils.data import IterableDataset, get_worker_info
    from torchdata.nodes import BaseNode, Loader
except ImportError as exc:  # exercised by .ci/wheel-smoke, in a venv without torch
    raise MissingDependency(
        f"asynccache.nodes needs torch and torchdata >= 0.10 (torchdata.nodes), and "
        f"{exc.name or 'one of them'} is missing: install torch first (the build your "
        f"machine wants, see the README's Installing), then pip install "
        f"'asynccache[torchdata]'"
    ) from exc

__all__ = ["CachedMapper", "NodeIterable"]

T = TypeVar("T")

#: How long the end of an epoch may wait for its writes (a value written in epoch 1 is
#: read in epoch 2 by every worker), in seconds.
EPOCH_FLUSH_TIMEOUT = 10.0
#: the read-ahead engine's attribute for each counter it keeps (the rest are the node's)
_ENGINE_COUNTERS = {"hits": "hits", "misses": "misses", "prefetch_hits": "prefetch_hits",
                    "stalls": "stalls", "stall_us": "stall_us",
                    "stall_timeouts": "stall_timeouts", "interrupted_reads": "interrupted"}


class _Entry:
    """One item pulled ahead: its key, its state, the compute of a miss. The engine
    reads it as an index (by identity): in flight, ready, or neither (not sent)."""

    __slots__ = ("future", "item", "key", "state")

    def __init__(self, item: Any, key: bytes, state: dict[str, Any] | None) -> None:
        self.item = item
        self.key = key
        self.state = state  # the source's state right after this item was pulled
        self.future: concurrent.futures.Future[Any] | None = None


def _key_of(entry: _Entry) -> bytes:
    return entry.key


class NodeRuntime(ProcessRuntime):
    """A node's runtime: the shared parts, the reader of the thread that drives the node
    (a new thread — a new epoch of a torchdata Prefetcher — gets a new one), and the pool
    that computes misses."""

    def __init__(self, node: CachedMapper[Any]) -> None:
        super().__init__(node.settings, node._reports, self.stats)
        self.node = node
        self.reader: Reader | None = None
        self.thread = 0
        self.pool: concurrent.futures.Executor | None = None

    def thread_reader(self) -> Reader:
        """The reader of the calling thread (made anew when another thread drives the node)."""
        ident = threading.get_ident()
        if self.reader is None or self.thread != ident:
            if self.reader is not None:
                self.reader.close()
            self.reader, self.thread = self.new_reader(), ident
        return self.reader

    def executor(self) -> concurrent.futures.Executor | None:
        node = self.node
        if node.num_workers == 0:
            return None
        if self.pool is None:
            if node.method == "thread":
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    node.num_workers, thread_name_prefix="asynccache-miss")
            else:
                ctx = multiprocessing.get_context(node.multiprocessing_context)
                self.pool = concurrent.futures.ProcessPoolExecutor(node.num_workers,
                                                                   mp_context=ctx)
        return self.pool

    def stats(self) -> dict[str, int]:
        """This process's counters: the cache's and the node's own."""
        total = self.port.counts()
        total.setdefault("computed", 0)
        for name, value in self.node._all_counts().items():
            total[name] = total.get(name, 0) + value
        return total

    def close(self, timeout: float) -> None:
        readers = [self.reader] if self.reader is not None else []
        for reader in readers:
            reader.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.finish(close=True, timeout=timeout, readers=readers)


def _map_only(map_fn: Callable[[Any], Any], item: Any) -> Any:
    """A miss computed in a worker process (encoded back in the node's process)."""
    return map_fn(item)


# torchdata ships no type information (no py.typed, no stubs): BaseNode is Any to mypy
class CachedMapper(UsesCacheSettings, BaseNode[T]):  # type: ignore[misc]
    """Yields ``map_fn(item)`` for each item of ``source``, cached in a shared store.

    Args:
        source: the ``torchdata.nodes`` node whose items are mapped (e.g.
            ``SamplerWrapper(sampler)``): its order is the read-ahead's, known exactly.
        map_fn: computes an item's value on a miss.
        client: a store client from `asynccache.connect()`.
        prefetch: items pulled ahead from the source and read from the store in batches
            (0: one item at a time), grown as the pipe's for small values and a store
            far away, within ``readahead_bytes`` (learned from the sizes read).
        namespace: the versioned name values are stored under; the same keys as a pipe
            with the same namespace. Without one the node gets a namespace of its own,
            whose values expire after a day.
        ttl: seconds (or a ``datetime.timedelta``) values live in the store; ``None``:
            no expiry (an unnamed namespace: a day).
        codec: how values become bytes (default ``Codec()``).
        on_error: ``"fallback"`` (default: a store failure is a counted miss) or
            ``"raise"``.
        key_fn: ``key_fn(item)`` is the cache key of an item (default: the item itself,
            e.g. the index a ``SamplerWrapper`` yields).
        num_workers: threads (``method="thread"``) or processes (``"process"``,
            ``map_fn`` must then pickle) that compute misses as soon as read-ahead finds
            them; 0 computes them in the calling thread when reached.
        method: ``"thread"`` or ``"process"``, for ``num_workers``.
        multiprocessing_context: the start method of those processes (default: the
            platform's).
        snapshot_frequency: how often (in items) the source's state is recorded for
            `get_state()`; resuming pulls (and drops) at most that many items from the
            source, without ``map_fn``. Recording it costs more than the cached read of
            an item (64: ~4.5x the items/s of 1 over a ``SamplerWrapper``); give 1 when
            the source itself is expensive to run forward.
        l1_bytes: an in-process LRU of this many bytes of encoded values in front of the
            store.
        readahead_bytes: the read-ahead's memory budget in this process (values in
            flight and arrived; default 32 MiB), as the pipe's. ``prefetch_bytes=`` is
            its former name.
    """

    SNAPSHOT_KEY = "snapshot"
    STEPS_KEY = "steps_since_snapshot"

    def __init__(
        self,
        source: BaseNode[Any],
        map_fn: Callable[[Any], T],
        client: BaseClient[Any],
        *,
        prefetch: int = 64,
        namespace: str | None = None,
        ttl: float | timedelta | None = None,
        codec: Codec | None = None,
        on_error: OnError = "fallback",
        key_fn: Callable[[Any], Any] | None = None,
        num_workers: int = 0,
        method: Literal["thread", "process"] = "thread",
        multiprocessing_context: str | None = None,
        snapshot_frequency: int = 64,
        l1_bytes: int | None = None,
        readahead_bytes: int | None = None,
        prefetch_bytes: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(source, BaseNode):
            raise ConfigError(f"CachedMapper's source must be a torchdata.nodes BaseNode "
                              f"(e.g. SamplerWrapper(sampler)), got {type(source).__name__}")
        if not callable(map_fn):
            raise ConfigError(f"map_fn must be callable, got {type(map_fn).__name__}")
        for name, value, low in (("prefetch", prefetch, 0), ("num_workers", num_workers, 0),
                                 ("snapshot_frequency", snapshot_frequency, 1)):
            if type(value) is not int or value < low:
                raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
        if method not in ("thread", "process"):
            raise ConfigError(f"method must be 'thread' or 'process', got {method!r}")
        #: the cache's settings, checked now, not in a worker; the namespace and its key
        #: rule (without namespace= one unique to this node) among them
        self.settings = CacheSettings(client, Keyspace(namespace, owner="a CachedMapper"),
                                      ttl, codec, on_error, None, l1_bytes)
        self.source = source
        self.map_fn = map_fn
        self.prefetch = prefetch
        self.key_fn = key_fn
        self.num_workers = num_workers
        self.method = method
        self.multiprocessing_context = multiprocessing_context
        self.snapshot_frequency = snapshot_frequency
        self._reports = JobStats(secrets.token_hex(8), self.namespace)
        self._reports.bind(self)
        self._strict = on_error == "raise"
        # read-ahead bounded in bytes too, as the pipe's (see readahead.prefetch): a small
        # first window until a reply shows the sizes, then sized by them
        self.readahead_bytes = readahead_budget(readahead_bytes, prefetch_bytes)
        self._prefetch = max(1, prefetch)
        growth = WINDOW_GROWTH if prefetch > 0 else 1  # 0: one item at a time
        self._sizer = WindowSizer(self._prefetch, self.readahead_bytes, growth)
        #: the read-ahead engine of the thread driving the node (`_engine_for`)
        self._engine: ReadAhead | None = None
        self._rt: NodeRuntime | None = None
        self._ahead: collections.deque[_Entry] = collections.deque()
        self._unsent: list[_Entry] = []
        #: a next() is under way or was stopped between two steps (see `_repair`)
        self._broken = False
        self._exhausted = False
        self._pulled = 0
        self._snapshot: dict[str, Any] | None = None
        self._since = 0
        self._counts = dict.fromkeys(NODE_COUNTERS, 0)
        #: this process's final counters once close() ran (then any use is an error)
        self._closed: dict[str, int] | None = None

    # -- runtime ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed is not None:
            raise ClosedError(f"{self!r} was used after close(): build a new node (its "
                              "stats() still gives this one's final counters)")

    def _runtime(self) -> NodeRuntime:
        rt = self._rt
        if rt is None or not rt.current():
            self._check_open()
            if rt is not None:
                park_inherited(rt)
            rt = self._rt = NodeRuntime(self)
            self._engine = None  # its reader was the old runtime's (a fork, a close)
        return rt

    def _engine_for(self, reader: Reader) -> ReadAhead:
        """The read-ahead engine over ``reader``: made anew when another thread drives
        the node (a torchdata Prefetcher's new epoch), keeping the values that had
        arrived; the reads still in flight on the old reader are sent again."""
        engine = self._engine
        if engine is not None and engine.reader is reader:
            return engine
        fresh = ReadAhead(reader, _key_of, self._strict, self._sizer)
        if self.num_workers:
            fresh.delivered = self._delivered
        if engine is not None:
            fresh.ready = engine.ready
            engine.ready = {}
            engine.forget()
            self._retire(engine)
        self._engine = fresh
        self._unsent = [entry for entry in self._ahead if entry not in fresh.ready]
        return fresh

    def _retire(self, engine: ReadAhead) -> None:
        """Keep the counters of an engine no longer used in the node's own."""
        for name, attribute in _ENGINE_COUNTERS.items():
            self._counts[name] += getattr(engine, attribute)
            setattr(engine, attribute, 0)

    def _all_counts(self) -> dict[str, int]:
        """The node's counters: its own, and its engine's."""
        counts = dict(self._counts)
        engine = self._engine
        if engine is not None:
            for name, attribute in _ENGINE_COUNTERS.items():
                counts[name] += getattr(engine, attribute)
        return counts

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_rt"] = None
        state["_engine"] = None
        state["_ahead"] = collections.deque()
        state["_unsent"] = []
        return state

    # -- keys -----------------------------------------------------------------------------
    def key_for(self, item: Any) -> bytes:
        """The store key of ``item`` (the pipe's scheme, on ``key_fn(item)``)."""
        return self.keyspace.key(item if self.key_fn is None else self.key_fn(item))

    # -- BaseNode contract -----------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        self._check_open()
        super().reset(initial_state)
        self._drop_ahead()
        self._exhausted = False
        self._pulled = 0
        if initial_state is not None:
            self.source.reset(initial_state[self.SNAPSHOT_KEY])
            for _ in range(initial_state[self.STEPS_KEY]):  # fast-forward: no map_fn
                next(self.source)
        else:
            self.source.reset(None)
        self._snapshot = self.source.state_dict()
        self._since = 0

    def get_state(self) -> dict[str, Any]:
        return {self.SNAPSHOT_KEY: self._snapshot, self.STEPS_KEY: self._since}

    def next(self) -> T:
        rt = self._runtime()
        engine = self._engine_for(rt.thread_reader())
        if self._broken:
            self._repair(engine)
        self._broken = True
        self._fill(engine)
        if not self._ahead:
            self._broken = False
            rt.flush(EPOCH_FLUSH_TIMEOUT)  # epoch 1's values are there for epoch 2
            raise StopIteration
        entry = self._ahead.popleft()  # an exception from here on costs this item only
        value = self._value_of(entry, rt, engine)
        self._broken = False
        if entry.state is not None:
            self._snapshot, self._since = entry.state, 0
        else:
            self._since += 1
        return value  # type: ignore[no-any-return]

    def _repair(self, engine: ReadAhead) -> None:
        """The last next() was stopped by an exception between two steps (an interrupt):
        what its reader had on the wire and what the engine recorded may disagree. The
        engine starts afresh (`ReadAhead.repair`) and every entry whose value had not
        arrived is sent again; arrived values are kept. The item being pulled from the
        source at that moment, or being returned, may be lost (never another item's
        value returned)."""
        engine.repair()
        self._unsent = [entry for entry in self._ahead if entry not in engine.ready]
        self._broken = False

    # -- read-ahead ----------------------------------------------------------------------------
    def _fill(self, engine: ReadAhead) -> None:
        """Pull items until the window is full; send their reads a batch at a time."""
        ahead = self._ahead
        while not self._exhausted and len(ahead) < engine.window:
            try:
                item = next(self.source)
            except StopIteration:
                self._exhausted = True
                break
            self._pulled += 1
            state = (self.source.state_dict()
                     if self._pulled % self.snapshot_frequency == 0 else None)
            entry = _Entry(item, self.key_for(item), state)
            ahead.append(entry)
            self._unsent.append(entry)
            if len(self._unsent) >= engine.batch:
                self._send(engine)
        unsent = self._unsent
        if unsent and (self._exhausted or unsent[0] is ahead[0]):
            self._send(engine)  # the next item must be asked for now

    def _send(self, engine: ReadAhead) -> None:
        entries, self._unsent = self._unsent, []
        engine._submit(entries)
        engine._deliver(engine.reader.poll())

    def _delivered(self, ticket: Ticket) -> None:
        """Misses found by read-ahead go to the workers at once (computed ahead)."""
        rt = self._rt
        pool = rt.executor() if rt is not None else None
        if pool is None:
            return
        for entry, value in zip(ticket.indices, ticket.values):
            if (value is MISSING or value is NOT_READ) and entry.future is None:
                entry.future = self._start_compute(pool, entry)

    def _start_compute(self, pool: concurrent.futures.Executor, entry: _Entry
                       ) -> concurrent.futures.Future[Any]:
        if self.method == "process":
            return pool.submit(_map_only, self.map_fn, entry.item)
        return pool.submit(self._compute_encoded, entry)

    def _compute_encoded(self, entry: _Entry) -> tuple[Any, dict[bytes, bytes]]:
        """A miss in a worker thread: computed and encoded there (both off the consumer)."""
        value = self.map_fn(entry.item)
        rt = self._runtime()
        return value, rt.port.encode({entry.key: value})

    def _value_of(self, entry: _Entry, rt: NodeRuntime, engine: ReadAhead) -> Any:
        """The entry's value read ahead (waited for when still on the wire), else
        computed (a miss). A read that failed is a miss; in raise mode it is read again
        now, and raises if the store still fails (a fresh error, as the pipe's)."""
        value = engine._await(entry)
        if value is NOTHING:
            value = engine._read_direct([entry])[0] if self._strict else MISSING
        value = engine._result(value)
        if value is not MISSING:
            return value
        return self._computed(entry, rt)

    def _computed(self, entry: _Entry, rt: NodeRuntime) -> Any:
        """A miss: a value this process wrote lately (read your writes: the source may
        yield an item twice), else its worker's result or computed here, written back."""
        found = rt.port.read_own_writes([entry.key])
        if found:
            if entry.future is not None:
                entry.future.cancel()  # computed ahead in vain, if it started
            return found[entry.key]
        rt.port.count("computed", 1)
        if entry.future is None:
            value = self.map_fn(entry.item)
            rt.port.queue_writes(rt.port.encode({entry.key: value}))
            return value
        self._counts["computed_ahead"] += 1
        result = entry.future.result()
        if self.method == "process":
            rt.port.queue_writes(rt.port.encode({entry.key: result}))
            return result
        value, blobs = result
        rt.port.queue_writes(blobs)
        return value

    def _drop_ahead(self) -> None:
        """Forget read-ahead (a reset): reads in flight are ignored, computes cancelled."""
        if self._engine is not None:
            self._engine.forget()
        for entry in self._ahead:
            if entry.future is not None:
                entry.future.cancel()
        self._ahead.clear()
        self._unsent = []

    # -- lifecycle ---------------------------------------------------------------------------
    def stats(self, per_process: bool = False) -> Any:
        """The cache's counters plus the node's: hits, misses, prefetch_hits, stalls,
        computed (computed_ahead of them by the workers), ..., and ``hit_rate`` (a float,
        as the pipe's). In the process that built
        the node, summed over every copy of it (DataLoader workers; see the pipe's
        ``stats``).

        Args:
            per_process: ``{pid: counters}`` instead of the sum.
        """
        rt = self._rt
        if self._closed is not None:
            local = dict(self._closed)
        elif rt is None or not rt.current():
            local = dict.fromkeys(CACHE_COUNTERS, 0)
            local.setdefault("computed", 0)
            for name, value in self._all_counts().items():
                local[name] = local.get(name, 0) + value
        else:
            local = rt.stats()
        return self._reports.stats(local, per_process)

    def latency(self, per_process: bool = False) -> Any:
        """Durations of the node's store requests, ``{"read": Latency, "write": Latency}``,
        summed over the processes of the job like `stats()`.

        Args:
            per_process: ``{pid: {kind: Latency}}`` instead of the sum.
        """
        return self._reports.latency(self._rt, per_process)

    def flush(self, timeout: float = EPOCH_FLUSH_TIMEOUT) -> None:
        """Wait until pending write-behind entries are in the store (at most ``timeout``
        seconds)."""
        if self._rt is not None:
            self._rt.flush(timeout)

    def close(self, timeout: float = EPOCH_FLUSH_TIMEOUT) -> None:
        """Flush pending writes, stop the workers, close this process's connections.

        Using the node afterwards raises `ClosedError`; ``stats()`` keeps the final
        counters. Closing twice does nothing.

        Args:
            timeout: seconds the flush may take.
        """
        if self._closed is not None:
            return
        self._drop_ahead()
        rt = self._rt
        if rt is not None and rt.current():
            rt.close(timeout)
        self._closed = self.stats(per_process=True)[os.getpid()]
        self._rt = None

    def __del__(self) -> None:
        rt = getattr(self, "_rt", None)
        if rt is not None and rt.pool is not None and rt.fork_generation == _fork.generation:
            rt.pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return (f"CachedMapper({type(self.source).__name__}, {self.client!r}, "
                f"prefetch={self.prefetch}, namespace={self.namespace!r})")


class NodeIterable(IterableDataset[Any]):
    """A node as a stateful ``IterableDataset``, for ``DataLoader`` and
    ``StatefulDataLoader`` (with workers too).

    ``state_dict()`` / ``load_state_dict()`` delegate to a ``torchdata.nodes.Loader``
    over the node, so a StatefulDataLoader resumes each worker exactly where it was.

    Args:
        make_node: ``make_node(worker_id, num_workers)`` builds the node of one worker
            (``0, 1`` without workers), e.g. over that worker's shard of the sampler.
    """

    def __init__(self, make_node: Callable[[int, int], BaseNode[Any]]) -> None:
        super().__init__()
        self.make_node = make_node
        self._loader: Loader[Any] | None = None
        self._state: dict[str, Any] | None = None
        #: a CachedMapper that ``make_node`` builds without ``namespace=`` gets this plus
        #: its rank among them: every worker and epoch (copies of this object) then reads
        #: the same values, and no other pipeline's (see `anonymous_scope`)
        self._anonymous = unique_namespace()

    def _current(self) -> Loader[Any]:
        if self._loader is None:
            info = get_worker_info()
            worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
            with anonymous_scope(self._anonymous, quiet=info is not None):
                node = self.make_node(worker, workers)
            self._loader = Loader(node)
            if self._state is not None:
                self._loader.load_state_dict(self._state)
                self._state = None
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        yield from self._current()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._current().state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = state_dict
        self._loader = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loader"] = None
        return state
