"""Counters that stay exact under threads, and the "log each kind of failure once" rule.

The counters are kept in a shard per thread (`asynccache.observe.shards` says why) and
summed when read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .catalog import CACHE_COUNTERS
from .shards import ThreadShards

__all__ = ["HIT_RATE", "Counters", "FailureLog", "with_hit_rate"]

#: The one entry of a public ``stats()`` that is not a counter (a float in [0, 1]).
HIT_RATE = "hit_rate"


def with_hit_rate(counters: dict[str, int]) -> dict[str, Any]:
    """``counters`` and ``hit_rate``: the share of reads the store (or L1, or read-ahead)
    answered, ``hits / (hits + misses + recalled)``; 0.0 before any read. What a user
    printing ``dp.stats()`` looks for first; the counters stay ints (summed across
    processes and published as they are), the rate is computed from their sums."""
    hits = counters.get("hits", 0)
    reads = hits + counters.get("misses", 0) + counters.get("recalled", 0)
    return {**counters, HIT_RATE: hits / reads if reads else 0.0}

logger = logging.getLogger("asynccache")

class Counters:
    """Named int counters, one shard per thread; `snapshot()` sums them."""

    def __init__(self, names: Iterable[str] = CACHE_COUNTERS) -> None:
        self.names = tuple(names)
        self._shards = ThreadShards(lambda: dict.fromkeys(self.names, 0), _fold)
        #: this thread's counters (made on its first use); only this thread writes them
        self.shard: Callable[[], dict[str, int]] = self._shards.mine

    def add(self, name: str, n: int = 1) -> None:
        shard = self.shard()
        shard[name] = shard.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        """The sum over every thread, as a new dict (every name listed, even at zero)."""
        return self._shards.total()


def _fold(into: dict[str, int], shard: dict[str, int]) -> None:
    for name, value in dict(shard).items():  # dict(): one C-level copy of a live shard
        into[name] = into.get(name, 0) + value


class FailureLog:
    """Logs the first failure of each kind at WARNING, the rest at DEBUG.

    A dead store fails every batch; one line per item (or per batch) would bury the
    training log. The counters keep the totals (they are never deduplicated: only the
    log is).

    "First" is per process unless ``claim`` is given: then the first time a process
    sees a kind it asks ``claim(kind)`` whether it is the first of the whole job (a pipe
    or node passes its stats board's `StatsBoard.claim()`), so two
    DataLoader workers, or the fresh workers of every epoch, log a dead store once.
    """

    def __init__(self, claim: Callable[[str], bool] | None = None) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.claim = claim

    def first(self, operation: str, exc: BaseException) -> bool:
        """True the first time this (operation, error type) is seen (in the job, with
        ``claim``; in this process otherwise)."""
        kind = (operation, type(exc).__name__)
        with self._lock:
            if kind in self._seen:
                return False
            self._seen.add(kind)
        claim = self.claim
        return claim is None or claim(f"{operation}-{kind[1]}")

    def report(self, operation: str, exc: BaseException, context: str) -> None:
        if not self.first(operation, exc):
            logger.debug("asynccache %s failed again (%s): %s", operation, context, exc)
            return
        logger.warning(
            "asynccache: %s failed (%s): %s — falling back to the source; further "
            "%s errors of this kind are counted in stats() and logged at DEBUG",
            operation, context, exc, type(exc).__name__,
        )
