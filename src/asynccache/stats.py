"""Counters the cache keeps, and the "log each kind of failure once" rule.

Counters are plain ints in a dict, updated only from the event loop that owns the
cache (no locks needed); ``snapshot()`` copies them for other threads.
"""

from __future__ import annotations

import logging
from collections import Counter

__all__ = ["FailureLog", "Stats"]

logger = logging.getLogger("asynccache")

_CORE_COUNTERS = (
    "hits", "misses", "errors", "decode_errors", "timeouts", "unavailable",
    "skipped", "batches", "keys_requested", "coalesced", "bytes_read",
    "sets", "set_batches", "bytes_written", "writes_dropped", "chunked_values",
    "batch_time_us",
)


class Stats(Counter[str]):
    """A Counter that always lists the core counters, even at zero."""

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(_CORE_COUNTERS, 0))

    def snapshot(self) -> dict[str, int]:
        return {name: int(value) for name, value in self.items()}


class FailureLog:
    """Logs the first failure of each kind at WARNING, the rest at DEBUG.

    A dead store fails every batch; one line per item (or per batch) would bury the
    training log. The counters in :class:`Stats` keep the totals.
    """

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def report(self, operation: str, exc: BaseException, context: str) -> None:
        kind = (operation, type(exc).__name__)
        if kind in self._seen:
            logger.debug("asynccache %s failed again (%s): %s", operation, context, exc)
            return
        self._seen.add(kind)
        logger.warning(
            "asynccache: %s failed (%s): %s — falling back to the source; further "
            "%s errors of this kind are counted in stats() and logged at DEBUG",
            operation, context, exc, type(exc).__name__,
        )
