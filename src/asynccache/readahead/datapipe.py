"""``AsyncKVCacheMapDataPipe``: a shared, remote replacement for ``InMemoryCacheHolder``.

Why it is built this way: docs/design.md, "The pipe".
"""

from __future__ import annotations

import logging
import operator
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .. import _fork
from .._fork import park_inherited
from ..cache.port import MISSING, CacheSettings, Codec, Keyspace, OnError, Visible
from ..errors import ClosedError, ConfigError, KeyEncodingError
from ..observe.catalog import CACHE_COUNTERS
from ..store.api import BaseClient
from . import order as orders
from .pipe_runtime import PipeRuntime, PipeShape
from .prefetch import Prefetcher
from .runtime import JobStats, UsesCacheSettings
from .window import readahead_budget

logger = logging.getLogger("asynccache")

if TYPE_CHECKING:  # the checker sees torch's generic base; torch is optional at run time
    from torch.utils.data import MapDataPipe
    from torch.utils.data import functional_datapipe as _functional_datapipe

    _Base = MapDataPipe[Any]
else:
    try:  # torch is optional: without it the class is a plain map-style wrapper
        from torch.utils.data import MapDataPipe as _Base
        from torch.utils.data import functional_datapipe as _functional_datapipe
    except ImportError:  # pragma: no cover - exercised only where torch is absent
        _Base = object
        _functional_datapipe = None

__all__ = ["AsyncKVCacheMapDataPipe"]

#: How long close() / worker exit may spend flushing pending writes, in seconds.
CLOSE_TIMEOUT = 10.0
_runtime_lock = threading.Lock()


def _new_runtime_lock() -> None:
    global _runtime_lock
    _runtime_lock = threading.Lock()  # the parent's may have been held by another thread


_fork.at_fork(in_child=_new_runtime_lock)


class AsyncKVCacheMapDataPipe(UsesCacheSettings, _Base):
    """Caches a map-style dataset in a shared key-value store, with batched read-ahead
    (functional name: ``async_kv_cache``).

    ``dp[i] == source[i]`` for every index, whatever the store does: values come from the
    store when it holds them, read ahead in batched multi-gets; a miss is computed from
    ``source`` in the calling thread and written back behind. Works on any ``source``
    with ``__getitem__`` and ``__len__``; a DataLoader reads whole batches through
    ``__getitems__`` (one request per batch).

    Args:
        source: the map-style dataset (or ``MapDataPipe``) whose items are cached.
        client: a store client from `asynccache.connect()`: picklable configuration,
            it connects lazily in each process (DataLoader workers included).
        prefetch: upcoming indices read ahead per reading thread (per node of a pool or
            cluster); grown up to 4x for small values and for a store far away (while
            the consumer waits and more in flight makes it faster), within
            ``readahead_bytes``; 0 turns read-ahead off.
        namespace: the versioned name values are stored under (``"imagenet-v3"``), to
            reuse them across runs and jobs. Without one the pipe gets a namespace of
            its own, shared by its copies only, whose values expire after a day.
        ttl: seconds (or a ``datetime.timedelta``) values live in the store; ``None``:
            no expiry (an unnamed namespace: a day).
        codec: how values become bytes (default ``Codec()``: pickle 5, bound to the key;
            ``Codec(secret=...)`` signs, ``Codec(allow_pickle=False)`` never unpickles).
        on_error: ``"fallback"`` (default: a store failure is a counted miss, logged
            once) or ``"raise"``.
        order: the indices that will be read next (a list, array, tensor, sampler or
            iterator); ``set_order(loader.batch_sampler)`` follows a DataLoader.
        lease: seconds; the first process to miss a key computes it while the others
            wait for its value. Must outlast a batch's computations.
        l1_bytes: an in-process LRU of this many bytes of encoded values in front of the
            store (hits counted as ``l1_hits``).
        readahead_bytes: the read-ahead's memory budget in this process (values in
            flight and arrived, shared by the threads reading at once; default 32 MiB).
            Each item counts at the largest size recent replies showed, so a mix of
            small and large values stays within it. ``prefetch_bytes=`` is its former
            name.

    Example:
        >>> import asynccache as ac
        >>> from torch.utils.data.datapipes.map import SequenceWrapper
        >>> client = ac.connect("memory://example")
        >>> dp = SequenceWrapper([10, 20, 30]).async_kv_cache(client, namespace="ex-v1")
        >>> dp[1], len(dp), dp.__getitems__([2, 0])
        (20, 3, [30, 10])
        >>> dp.close()
    """

    def __init__(
        self,
        source: Any,
        client: BaseClient[Any],
        prefetch: int = 64,
        namespace: str | None = None,
        ttl: float | timedelta | None = None,
        codec: Codec | None = None,
        on_error: OnError = "fallback",
        order: Iterable[Any] | None = None,
        *,
        lease: float | None = None,
        l1_bytes: int | None = None,
        readahead_bytes: int | None = None,
        prefetch_bytes: int | None = None,
    ) -> None:
        if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
            raise ConfigError(
                f"async_kv_cache needs a map-style source with __getitem__ and __len__, "
                f"got {type(source).__name__}"
            )
        if type(prefetch) is not int or prefetch < 0:
            raise ConfigError(f"prefetch must be an int >= 0, got {prefetch!r}")
        budget = readahead_budget(readahead_bytes, prefetch_bytes)
        #: the cache's settings, checked here, in the caller, not later in a DataLoader
        #: worker; the namespace and its key rule (without namespace= one unique to this
        #: pipe) among them
        self.settings = CacheSettings(
            client, Keyspace(namespace, owner="an async_kv_cache pipe"), ttl, codec,
            on_error, lease, l1_bytes)
        self.source = source
        self.prefetch = prefetch
        self.readahead_bytes = budget
        self._mapping = orders.mapping_behind(source)
        self._take_order(order)
        self._reports = JobStats(secrets.token_hex(8), self.namespace)
        self._reports.bind(self)
        self._rt: PipeRuntime | None = None
        #: this process's final counters once close() ran (then any read is an error)
        self._closed: dict[str, int] | None = None

    # -- runtime ---------------------------------------------------------------------------
    def _runtime(self) -> PipeRuntime:
        rt = self._rt
        if rt is not None and rt.current():
            return rt
        if self._closed is not None:
            raise ClosedError(f"{self!r} was used after close(): build a new pipe (its "
                              "stats() still gives this one's final counters)")
        with _runtime_lock:  # threads reading a fresh pipe at once must share one runtime
            rt = self._rt
            if rt is None or not rt.current():
                if rt is not None:
                    park_inherited(rt)  # the parent's prefetchers, sockets and locks
                rt = self._rt = PipeRuntime(self.settings, self._reports, self._shape())
                rt.loop.add_shutdown_hook(self)
                if self.client.process_local and orders.worker_info() is not None:
                    rt.warn_process_local()
        return rt

    def _shape(self) -> PipeShape:
        return PipeShape(len(self), self._fast_length(), self._mapping is not None,
                         self.prefetch, self.readahead_bytes, self._follow_order)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_rt"] = None
        state["_order_start"] = None  # the owner's; a worker follows its own copy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- indices, keys and orders ----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.source)

    def key_for(self, index: Any) -> bytes:
        """The store key of ``index``: ``b"ac:" + namespace + b":" + str(index)`` for an
        int; other keys by the documented key encoding (docs/design.md, "Keys")."""
        return self.keyspace.key(index)

    def _fast_length(self) -> int:
        """``0 <= i < _fast_length()`` for an int ``i`` means it is its own canonical form
        (-1 for a keyed source: nothing is)."""
        return len(self.source) if self._mapping is None else -1

    def _normalize_all(self, indices: Iterable[Any], fast: int) -> list[Any]:
        """`_normalize` of each index, skipped for the in-range ints (most of them): it
        would run once per item on the hit path."""
        return [i if type(i) is int and 0 <= i < fast else self._normalize(i)
                for i in indices]

    def _normalize(self, index: Any) -> Any:
        """The canonical form of an index: an int in range for a sequence source (numpy
        and torch integers converted, negatives counted from the end), the key itself
        for a keyed source. ``dp[i]`` and ``order`` go through the same rule."""
        if self._mapping is not None:
            if isinstance(index, str | bytes | tuple):
                return index
            try:
                return operator.index(index)
            except TypeError:
                return index  # the key encoding decides (and explains) what is refused
        try:
            i = operator.index(index)
        except TypeError:
            if isinstance(index, str | bytes | tuple):
                return index  # a source indexed by something else: cache under that key
            # a TypeError as a list's, and a CacheError: the key encoding has no float
            raise KeyEncodingError(
                f"indices must be integers (or keys of a keyed source), got "
                f"{type(index).__name__}: {index!r}; pass int(i), or a source keyed by "
                f"str/bytes/tuple keys") from None
        n = len(self.source)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for a dataset of length {n}")
        return i

    def _take_order(self, order: Iterable[Any] | None) -> None:
        """``order`` checked, its samplers made followable, and as it is now (`Start`)."""
        self.order = self._check_order(order)
        self._order_start = orders.Start.of(self.order)

    def _check_order(self, order: Iterable[Any] | None) -> Iterable[Any] | None:
        if order is None:
            return None
        if isinstance(order, str | bytes) or not isinstance(order, Iterable):
            raise ConfigError(f"order must be an iterable of indices (a list, array, tensor "
                              f"or sampler), got {type(order).__name__}")
        if iter(order) is order:  # an iterator: consume it once, reuse it every epoch
            order = list(order)
        try:
            empty = len(order) == 0  # type: ignore[arg-type]
        except TypeError:
            empty = False
        if empty:
            raise ConfigError("order is empty: pass the indices that will be read, or "
                              "order=None to let asynccache detect sequential reads")
        orders.seed_generators(order)  # followable in every worker (see there)
        return order

    def _plan_from(self, items: list[Any]) -> list[Any]:
        try:
            return self._normalize_all(items, self._fast_length())
        except (IndexError, TypeError) as exc:
            raise ConfigError(f"order contains an index this dataset does not have: "
                              f"{exc}") from exc

    def _process_plan(self, items: list[Any], rt: PipeRuntime) -> list[Any]:
        """This process's plan from one pass over the order.

        In a DataLoader worker it is the worker's share: the DataLoader hands batches to
        workers round-robin, so worker ``w`` of ``W`` gets batches ``w, w+W, ...``. The
        batches are the order's own when it yields lists (a batch sampler), else the
        order cut into batches of the size of the first ``__getitems__`` call.
        """
        batches: list[Any] | None = items if items and type(items[0]) is list else None
        worker = orders.worker_info()
        if worker is not None and batches is None and rt.batch_size:
            size = rt.batch_size
            batches = [items[i:i + size] for i in range(0, len(items), size)]
        if batches is None:
            return self._plan_from(items)
        if worker is not None:
            batches = batches[worker.id::worker.num_workers]
        return self._plan_from([i for batch in batches for i in batch])

    def _follow_order(self) -> tuple[list[Any], Callable[[Any], list[Any]]] | None:
        """The order to follow, for a prefetcher asking (its plan and the next epochs')."""
        order = self.order
        rt = self._rt
        if order is None or rt is None:
            return None

        draws = orders.EpochDraws(order, self._order_start)

        def starts_with(first: Any) -> Callable[[list[Any]], bool]:
            def fits(items: list[Any]) -> bool:
                plan = self._process_plan(items, rt)
                return bool(plan) and plan[0] == first
            return fits

        def next_epoch(first: Any = None) -> list[Any]:
            rt.drawn = draws.next() if first is None else draws.find(starts_with(first))
            return self._process_plan(rt.drawn, rt)

        return next_epoch(), next_epoch

    # -- map-style protocol --------------------------------------------------------------------
    def __getitem__(self, index: Any) -> Any:
        rt = self._rt
        if rt is None or rt.fork_generation != _fork.generation:
            rt = self._runtime()
        try:
            p = rt.local.prefetcher
        except AttributeError:
            p = rt.prefetcher()
        if type(index) is not int or not 0 <= index < rt.fast_length:
            index = self._normalize(index)
        value = p.take(index)
        if value is MISSING:
            value = self._compute([index], rt)[index]
        return value

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        """A whole batch with one store request; misses computed and written back."""
        rt = self._runtime()
        indices = self._normalize_all(indices, rt.fast_length)
        p = rt.prefetcher()
        if rt.batch_size is None:
            rt.batch_size = len(indices)
            if rt.drawn is not None and orders.worker_info() is not None:
                # a flat order in a DataLoader worker: now its share can be cut out
                plan, replan = self._process_plan(rt.drawn, rt), p.replan
                if replan is not None:
                    p.follow(plan, replan)  # the epoch clock counts this worker's share
                else:
                    p.set_plan(plan)
        values = p.take_many(indices)
        missing = [i for i, v in zip(indices, values) if v is MISSING]
        # In a DataLoader worker a batch's writes are in the store before its next batch
        # is returned (they go out at once, while the next batch is computed); the last
        # batch of a known plan (this worker's share of the sampler's epoch, or the rest
        # of the dataset) waits for its own, so that every worker finds them in the next
        # epoch. Less than a batch left counts as the end: with drop_last the loader never
        # sends it. Without a plan the end is not known: the last batch's writes are on
        # their way when the epoch ends (a worker that exits flushes them first), so a
        # read of one of those keys by another worker in the first milliseconds of the
        # next epoch may miss and compute it again, never read something else. Outside
        # workers, a batch without a plan waits for its own writes: what the caller does
        # next (read them back, look at the store) finds them there.
        left = p.plan_len - p.pos
        if p.plan_len:
            # (a plan used up by this batch is already the next epoch's guess, unread)
            ends = (left < max(1, len(indices)) or p.epoch_ends()
                    or (p.tentative and not p.pos))
        else:
            ends = orders.worker_info() is None
        visible: Visible = "now" if ends else "next"
        if missing:
            computed = self._compute(missing, rt, visible=visible)
            values = [computed[i] if v is MISSING else v for i, v in zip(indices, values)]
        else:
            rt.port.wait_for_writes()
        if len(set(indices)) < len(indices):
            values = self._own_objects(indices, values, rt)
        if orders.worker_info() is not None:  # counted where the loop looks, before it gets them
            rt.publish(latency=False)
        return values

    def _own_objects(self, indices: list[Any], values: list[Any], rt: PipeRuntime) -> list[Any]:
        """A batch that holds an index more than once (a sampler with replacement): every
        position after the first gets a copy of its own, decoded afresh."""
        seen: set[Any] = set()
        out = []
        for index, value in zip(indices, values):
            if index in seen:
                value = rt.port.copy_of(self.key_for(index), value)
            else:
                seen.add(index)
            out.append(value)
        return out

    def _compute(self, indices: list[Any], rt: PipeRuntime,
                 visible: Visible = "queued") -> dict[Any, Any]:
        """Compute misses in this thread and write them back (see `CachePort.compute()`)."""
        wanted = {self.key_for(i): i for i in dict.fromkeys(indices)}
        computed = rt.port.compute(wanted, self.source.__getitem__, visible=visible)
        return {wanted[key]: value for key, value in computed.items()}

    def __iter__(self) -> Iterator[Any]:
        rt = self._runtime()
        if self.order is not None:
            plan: Sequence[Any] = self._plan_from(orders.one_pass(self.order))
        elif self._mapping is not None:
            plan = list(self._mapping.keys())
        else:
            plan = range(len(self))
        rt.prefetcher().set_plan(plan)
        for index in plan:
            yield self[index]

    def set_order(self, order: Iterable[Any]) -> None:
        """Tell the prefetchers the indices that will be read next (every thread's, at its
        next read); re-iterated when used up."""
        self._take_order(order)
        self._runtime().order_changed()

    # -- lifecycle -------------------------------------------------------------------------
    def stats(self, per_process: bool = False) -> Any:
        """hits, misses, errors, prefetch_hits, stalls, computed, bytes_read, ... (ints),
        and ``hit_rate`` (a float: hits / (hits + misses + recalled), over the same sum).

        In the process that built the pipe: the sum over every copy of it — this
        process's and those of DataLoader workers, as of their last report (a worker
        reports before it hands over each batch: every read of the batches the loop has
        received is counted; reads through ``dp[i]`` in a worker, once a second; final
        once they exited). In a worker: that worker's own.

        Args:
            per_process: ``{pid: counters}`` instead of the sum.
        """
        local = self._local_stats() if self._closed is None else dict(self._closed)
        return self._reports.stats(local, per_process)

    def latency(self, per_process: bool = False) -> Any:
        """Durations of this pipe's store requests, ``{"read": Latency, "write": Latency}``
        (see `AsyncKVCache.latency()`), summed over the processes of the job like `stats()`.

        Args:
            per_process: ``{pid: {kind: Latency}}`` instead of the sum.
        """
        return self._reports.latency(self._rt, per_process)

    def _local_stats(self) -> dict[str, int]:
        rt = self._rt
        if rt is None or not rt.current():  # nothing happened in this process yet
            return {**dict.fromkeys(CACHE_COUNTERS, 0),
                    **Prefetcher.zero_counts(), "computed": 0}
        return rt.stats()

    def flush(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Wait until pending write-behind entries are in the store (at most ``timeout``
        seconds)."""
        rt = self._rt
        if rt is not None:
            rt.flush(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Flush pending writes, then close this process's connections (bounded).

        The client stays usable (it reconnects lazily); the pipe does not: a read after
        close() raises `ClosedError`. ``stats()`` keeps answering with the final counters.
        Closing twice does nothing.

        Args:
            timeout: seconds the flush may take.
        """
        if self._closed is not None:
            return
        rt = self._rt
        final = self._local_stats()
        if rt is not None and rt.current():
            rt.close(timeout)
            final = rt.stats()
        self._closed, self._rt = final, None

    def _on_loop_shutdown(self) -> None:
        self.close()

    def __enter__(self) -> AsyncKVCacheMapDataPipe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AsyncKVCacheMapDataPipe({type(self.source).__name__}, {self.client!r}, "
                f"prefetch={self.prefetch}, namespace={self.namespace!r})")

    # torch's datapipes print only their class name: print(dp) shows what repr() does
    __str__ = __repr__


def _register_functional_form() -> None:
    """``MapDataPipe.async_kv_cache(client, ...)``, once per process (reload-safe)."""
    if _functional_datapipe is None or "async_kv_cache" in _Base.functions:
        return
    _functional_datapipe("async_kv_cache")(AsyncKVCacheMapDataPipe)


def _forward_getitems_through_dataloader_wrapper() -> None:
    """Let torch's DataLoader reach ``__getitems__`` of a wrapped MapDataPipe.

    ``DataLoader.__init__`` wraps every ``MapDataPipe`` in
    ``_MapDataPipeSerializationWrapper``, which defines only ``__getitem__``; the
    fetcher then reads a batch one item (one store round trip) at a time. We add the
    missing method: it forwards to the wrapped pipe's ``__getitems__`` when it has one,
    and otherwise does exactly what the fetcher does without it.
    """
    try:
        from torch.utils.data.datapipes.datapipe import _MapDataPipeSerializationWrapper
    except ImportError:  # pragma: no cover - a torch without the wrapper needs nothing
        return
    if "__getitems__" in _MapDataPipeSerializationWrapper.__dict__:
        return

    def __getitems__(self: Any, indices: Sequence[int]) -> list[Any]:
        getitems = getattr(type(self._datapipe), "__getitems__", None)
        if getitems is None:
            return [self._datapipe[i] for i in indices]
        batch: list[Any] = getitems(self._datapipe, indices)
        return batch

    _MapDataPipeSerializationWrapper.__getitems__ = __getitems__  # type: ignore[attr-defined]


_register_functional_form()
_forward_getitems_through_dataloader_wrapper()
