"""``AsyncKVCacheMapDataPipe``: a shared, remote replacement for ``InMemoryCacheHolder``.

``dp[i]`` returns exactly ``source[i]``. Values come from the store when present (read
ahead in batches by the :class:`~asynccache.prefetch.Prefetcher`); on a miss the value
is computed in the caller's thread and queued for a batched write-behind. The store is
an optimisation: with ``on_error="fallback"`` a slow, dead or corrupt store only turns
hits into misses.

Namespace derivation (when ``namespace=None``): ``"auto-" + sha1`` of the source's
class (module and qualified name), its length and, when the source is a torch
``MapDataPipe`` chain, the repr of each stage. This separates different datasets and
lengths, but it cannot see inside your ``__getitem__``: change the code or the data
behind it and the old values are served. Give an explicit, versioned namespace
(``"imagenet-train-v3"``) for anything long-lived.

Keys: ``key_for(i) == b"ac:" + namespace + b":" + str(i)``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from . import _fork
from ._fork import park_inherited
from .clients.base import BaseClient
from .codec import Codec
from .core import MISSING, AsyncKVCache, OnError
from .errors import ConfigError, StoreError
from .loop import LoopThread, get_loop_thread
from .prefetch import Prefetcher
from .stats import Stats

try:  # torch is optional: without it the class is a plain map-style wrapper
    from torch.utils.data import MapDataPipe as _Base
    from torch.utils.data import functional_datapipe as _functional_datapipe
except ImportError:  # pragma: no cover - exercised only where torch is absent
    _Base = object  # type: ignore[assignment,misc]
    _functional_datapipe = None

__all__ = ["AsyncKVCacheMapDataPipe", "derive_namespace"]

#: How long close() / worker exit may spend flushing pending writes, in seconds.
CLOSE_TIMEOUT = 10.0


def derive_namespace(source: Any) -> str:
    """A deterministic namespace for ``source`` (see the module docstring for limits)."""
    parts = [type(source).__module__, type(source).__qualname__]
    try:
        parts.append(str(len(source)))
    except TypeError:
        pass
    node, seen = source, 0
    while node is not None and seen < 32:  # a torch datapipe chain: name each stage
        parts.append(type(node).__qualname__)
        fn = getattr(node, "fn", None)
        if fn is not None:
            parts.append(getattr(fn, "__module__", "") + "." + getattr(fn, "__qualname__", ""))
        node = getattr(node, "datapipe", None)
        seen += 1
    digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
    return f"auto-{digest}"


class _Runtime:
    """Per-process state: loop thread, prefetcher, pending writes. Never pickled."""

    def __init__(self, pipe: AsyncKVCacheMapDataPipe) -> None:
        self.fork_generation = _fork.generation
        self.length = len(pipe)
        self.loop: LoopThread = get_loop_thread()
        self.cache = AsyncKVCache(pipe.client, pipe.namespace, pipe.ttl, pipe.codec,
                                  pipe.on_error)
        self.prefetcher = Prefetcher(self.cache, self.loop, pipe.key_for, self.length,
                                     pipe.prefetch, wait_timeout=pipe.client.timeout * 3 + 1,
                                     reader=pipe.client.blocking_reader())
        self.lock = threading.Lock()
        self.writes: dict[bytes, bytes] = {}
        self.write_scheduled = False
        self.computed = 0
        self.loop.call_soon(self.cache.client.retain)

    def current(self) -> bool:
        """False in a forked child: this runtime (loop, sockets) is the parent's."""
        return self.fork_generation == _fork.generation

    def queue_writes(self, entries: dict[bytes, bytes]) -> None:
        with self.lock:
            self.writes.update(entries)
            if self.write_scheduled:
                return
            self.write_scheduled = True
        self.loop.call_soon(self._hand_over)

    def _hand_over(self) -> None:  # loop thread
        with self.lock:
            entries, self.writes, self.write_scheduled = self.writes, {}, False
        if entries:
            self.cache.write_behind(entries)

    async def finish(self, close: bool) -> None:
        """Write what is queued; with ``close``, also close this loop's connections."""
        self._hand_over()
        if close:
            await self.prefetcher.cancel_pending()
        await self.cache.flush()
        if close:
            await self.cache.client.release()


class AsyncKVCacheMapDataPipe(_Base):  # type: ignore[misc,valid-type]
    """Cache a map-style dataset in a shared key-value store, with batched prefetch.

    Works on any ``source`` with ``__getitem__`` and ``__len__``. ``order`` is an
    iterable of the indices that will be read next (a list, or a sampler with a fixed
    seed); it is re-iterated when exhausted. ``prefetch=0`` disables read-ahead.
    """

    def __init__(
        self,
        source: Any,
        client: BaseClient[Any],
        prefetch: int = 64,
        namespace: str | None = None,
        ttl: float | None = None,
        codec: Codec | None = None,
        on_error: OnError = "fallback",
        order: Iterable[int] | None = None,
    ) -> None:
        if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
            raise ConfigError(
                f"async_kv_cache needs a map-style source with __getitem__ and __len__, "
                f"got {type(source).__name__}"
            )
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch must be an int >= 0, got {prefetch!r}")
        self.source = source
        self.client = client
        self.prefetch = prefetch
        self.namespace = namespace if namespace is not None else derive_namespace(source)
        self.ttl = ttl
        self.codec = codec
        self.on_error: OnError = on_error
        self.order = order
        # Validates namespace / client / on_error now, in the caller, not in a worker.
        self._prefix = AsyncKVCache(client, self.namespace, ttl, codec, on_error).key("")
        self._rt: _Runtime | None = None

    # -- runtime ---------------------------------------------------------------------------
    def _runtime(self) -> _Runtime:
        rt = self._rt
        if rt is None or not rt.current():
            if rt is not None:
                park_inherited(rt)  # the parent's prefetcher, tasks and locks
            rt = self._rt = _Runtime(self)
            rt.loop.add_shutdown_hook(self)
            if self.order is not None:
                rt.prefetcher.set_plan(list(self.order), self.order)
        return rt

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_rt"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- map-style protocol --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.source)

    def key_for(self, index: int) -> bytes:
        """The store key of ``index``: ``b"ac:" + namespace + b":" + str(index)``."""
        return b"%b%d" % (self._prefix, index)

    def _check_index(self, index: int) -> int:
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"indices must be int, got {type(index).__name__}")
        n = len(self.source)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of length {n}")
        return index

    def __getitem__(self, index: int) -> Any:
        rt = self._rt
        if rt is None or rt.fork_generation != _fork.generation:
            rt = self._runtime()
        if type(index) is not int or not 0 <= index < rt.length:
            index = self._check_index(index)
        value = rt.prefetcher.take(index)
        if value is MISSING:
            value = self._compute({index: None}, rt)[index]
        return value

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A whole batch with one store request; misses computed and written back."""
        indices = [self._check_index(i) for i in indices]
        rt = self._runtime()
        values = rt.prefetcher.take_many(indices)
        missing = {i: None for i, v in zip(indices, values) if v is MISSING}
        if missing:
            computed = self._compute(missing, rt, wait=True)
            values = [computed[i] if v is MISSING else v for i, v in zip(indices, values)]
        return values

    def _compute(self, indices: dict[int, None], rt: _Runtime,
                 wait: bool = False) -> dict[int, Any]:
        """Compute misses in this thread and queue them for writing.

        With ``wait`` (whole batches, as the DataLoader asks for them) the batch is
        written with one pipelined request and the call returns once it is
        acknowledged (about one round trip per batch): a worker that hands back a batch
        has made it visible to every other worker. That is what makes epoch 2 compute
        nothing even with persistent workers. Single ``dp[i]`` reads only queue
        (write-behind); ``close()``/``flush()`` wait.
        """
        computed = {i: self.source[i] for i in indices}
        rt.computed += len(computed)
        rt.queue_writes(rt.cache.encode_entries({self.key_for(i): v for i, v in computed.items()}))
        if wait:
            self._finish(rt, close=False, timeout=max(self.client.timeout * 2, 1.0))
        return computed

    def __iter__(self) -> Iterator[Any]:
        rt = self._runtime()
        n = len(self)
        plan = list(self.order) if self.order is not None else range(n)
        rt.prefetcher.set_plan(plan)
        for index in plan:
            yield self[index]

    def set_order(self, order: Iterable[int]) -> None:
        """Tell the prefetcher the indices that will be read next; re-iterated when used up."""
        self.order = order
        self._runtime().prefetcher.set_plan(list(order), order)

    # -- lifecycle -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """hits, misses, errors, prefetch_hits, stalls, computed, bytes_read, ... (ints)."""
        rt = self._rt
        if rt is None or not rt.current():  # nothing happened in this process yet
            return {**Stats().snapshot(), **Prefetcher.zero_counts(), "computed": 0}
        return {**rt.cache.stats(), **rt.prefetcher.counts, "computed": rt.computed}

    def flush(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Wait until pending write-behind entries are in the store (bounded)."""
        self._finish(self._rt, close=False, timeout=timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Flush pending writes, then close this process's connections (bounded).

        The client stays usable (it reconnects lazily), and so does the pipe.
        """
        rt, self._rt = self._rt, None
        self._finish(rt, close=True, timeout=timeout)

    def _finish(self, rt: _Runtime | None, *, close: bool, timeout: float) -> None:
        if rt is None or not rt.current() or rt.loop.closed:
            return
        if close:
            rt.prefetcher.close()
        try:
            rt.loop.call(rt.finish(close), timeout)
        except (TimeoutError, StoreError) as exc:
            rt.cache.count("writes_dropped", len(rt.writes))
            rt.cache._failures.report("flush", exc, self.client.safe_url)

    def _on_loop_shutdown(self) -> None:
        rt, self._rt = self._rt, None
        self._finish(rt, close=True, timeout=CLOSE_TIMEOUT)

    def __enter__(self) -> AsyncKVCacheMapDataPipe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AsyncKVCacheMapDataPipe({type(self.source).__name__}, {self.client!r}, "
                f"prefetch={self.prefetch}, namespace={self.namespace!r})")


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
        return getitems(self._datapipe, indices)

    _MapDataPipeSerializationWrapper.__getitems__ = __getitems__  # type: ignore[attr-defined]


_register_functional_form()
_forward_getitems_through_dataloader_wrapper()
