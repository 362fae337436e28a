"""The one failure policy: what a store failure costs, per node, on every read and write path.

Why it is built this way: docs/design.md, "The failure policy".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from ..errors import (
    CacheError,
    DecodeError,
    FormatMismatch,
    SignatureError,
    StoreRejected,
    StoreTimeout,
    StoreUnavailable,
)
from ..observe.stats import Counters, FailureLog
from ..store.api import NodeName

__all__ = ["BACKOFF_MAX", "BACKOFF_START", "FailurePolicy", "OnError"]

OnError = Literal["fallback", "raise"]

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
_NOBODY: frozenset[NodeName] = frozenset()


class FailurePolicy:
    """Counting, logging once, per-node back-off, and fallback vs raise."""

    def __init__(self, on_error: OnError, counters: Counters, where: str) -> None:
        self.on_error: OnError = on_error
        self.strict = on_error == "raise"
        self.counters = counters
        self.where = where
        self.log = FailureLog()
        self._lock = threading.Lock()
        self._until: dict[NodeName, float] = {}    # node -> monotonic time its back-off ends
        self._backoff: dict[NodeName, float] = {}  # node -> length of its next back-off
        #: called (in the thread that saw it) when a node that had failed answers again:
        #: the cache writes what the store lacks (`asynccache.cache.writes.Writer.recover`)
        self.on_recovered: Callable[[], None] | None = None

    # -- asking -----------------------------------------------------------------------
    def down(self) -> frozenset[NodeName]:
        """Nodes to skip right now (always none in raise mode)."""
        if not self._until or self.strict:
            return _NOBODY
        now = time.monotonic()
        with self._lock:
            return frozenset(node for node, until in self._until.items() if now < until)

    def retry_in(self) -> float | None:
        """Seconds until the first node backing off may be asked again (None: none is)."""
        if not self._until:
            return None
        now = time.monotonic()
        with self._lock:
            ends = [until for until in self._until.values() if until > now]
        return min(ends) - now if ends else None

    # -- telling ----------------------------------------------------------------------
    def failed(self, node: NodeName, operation: str, exc: CacheError) -> None:
        """A request to ``node`` failed: count it, back the node off, log it once."""
        counters = self.counters.shard()
        counters["errors"] += 1
        if isinstance(exc, StoreTimeout):
            counters["timeouts"] += 1
        elif isinstance(exc, StoreUnavailable):
            counters["unavailable"] += 1
        elif isinstance(exc, StoreRejected):
            counters["rejected"] += 1
        if isinstance(exc, StoreTimeout | StoreUnavailable):
            now = time.monotonic()
            with self._lock:
                if now >= self._until.get(node, 0.0):
                    # a new failure, not another request of the same burst: back off,
                    # longer each time a probe after the back-off fails too
                    backoff = self._backoff.get(node, BACKOFF_START)
                    self._until[node] = now + backoff
                    self._backoff[node] = min(backoff * 2, BACKOFF_MAX)
        if not self.strict:
            self.log.report(operation, exc, node)

    def decode_failed(self, exc: DecodeError) -> None:
        """Bytes under a key could not be used (damaged, foreign, forged, other format)."""
        counters = self.counters.shard()
        if isinstance(exc, FormatMismatch):
            counters["outdated"] += 1
            return
        counters["errors"] += 1
        if isinstance(exc, SignatureError):
            # bytes somebody without the secret wrote: its own counter, its own warning
            counters["bad_signatures"] += 1
        else:
            counters["decode_errors"] += 1
        if not self.strict:
            self.log.report("decode", exc, self.where)

    def succeeded(self, node: NodeName) -> None:
        """``node`` answered: its back-off starts from the beginning next time, and
        if it had failed, `on_recovered` is told."""
        if node in self._backoff:
            with self._lock:
                recovered = self._backoff.pop(node, None) is not None
                self._until.pop(node, None)
            if recovered and self.on_recovered is not None:
                self.on_recovered()

    def skipped(self, n: int) -> None:
        self.counters.shard()["skipped"] += n
