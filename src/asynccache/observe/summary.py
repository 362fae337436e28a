"""One line of numbers for a training log, now (`summary_line()`) or every N seconds
(`log_summary()`).

Why a line and not a dashboard: most training runs are read through their log. A line a
minute with the hit rate, the errors and the store's latency tells whether the cache is
doing its job without anything else to set up; Prometheus (`asynccache.metrics`) is there
for those who run one.

The periodic logger is a daemon thread of the process that started it. It holds the
pipe, node or cache weakly (it stops once the object is gone), never runs in a forked
child (threads do not survive ``fork``; ``stop()`` there is a no-op), and logs at INFO
on ``asynccache.summary``, a logger left at INFO even though ``asynccache`` itself
stays at WARNING (see the package docstring): who starts it wants its lines.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from .. import _fork
from ..errors import ConfigError
from .catalog import ERROR_KINDS
from .histogram import Latency

__all__ = ["SummaryLogger", "log_summary", "summary_line"]


_logger = logging.getLogger("asynccache.summary")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1000
    if ms < 1:
        return f"{ms:.2f} ms"
    if ms < 1000:
        return f"{ms:.1f} ms"
    return f"{seconds:.2f} s"


def summary_line(obj: Any) -> str:
    """``asynccache ns=… hit 97.1% (12,345/12,714) errors 0 read 1.2 GB p50 0.40 ms …``

    For a pipe or node, over every process of the job (its ``stats()``); counts and
    quantiles since the start, quantiles of read requests interpolated in their bucket.
    """
    stats = obj.stats()
    latency: Latency = obj.latency().get("read", Latency())
    hits, misses = stats.get("hits", 0), stats.get("misses", 0)
    lookups = hits + misses + stats.get("recalled", 0)  # every read is one of the three
    rate = f"{100 * hits / lookups:.1f}%" if lookups else "-"
    errors = stats.get("errors", 0)
    parts = [f"{kind} {stats[kind]:,}" for kind in ERROR_KINDS if stats.get(kind)]
    error_text = f"errors {errors:,}" + (f" ({', '.join(parts)})" if parts else "")
    return (f"asynccache ns={obj.namespace} hit {rate} ({hits:,}/{lookups:,}) {error_text} "
            f"read {_size(stats.get('bytes_read', 0))} "
            f"written {_size(stats.get('bytes_written', 0))} "
            f"p50 {_duration(latency.quantile(0.5))} p99 {_duration(latency.quantile(0.99))}")


class SummaryLogger:
    """Logs `summary_line()` of one object every ``every`` seconds until stopped (the
    arguments are `log_summary()`'s)."""

    def __init__(self, obj: Any, every: float, logger: logging.Logger | None = None,
                 level: int = logging.INFO) -> None:
        if not isinstance(every, int | float) or every <= 0:
            raise ConfigError(f"every must be a positive number of seconds, got {every!r}")
        for name in ("stats", "latency", "namespace"):
            if not hasattr(obj, name):
                raise ConfigError(f"log_summary needs an AsyncKVCache, a pipe or a "
                                  f"CachedMapper, got {type(obj).__name__}")
        self.every = float(every)
        self.logger = logger if logger is not None else _logger
        self.level = level
        self._ref = weakref.ref(obj)
        self._generation = _fork.generation
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asynccache-summary",
                                        daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._generation == _fork.generation and self._thread.is_alive()

    def log_now(self) -> None:
        """Log the line once, now (nothing if the object is gone)."""
        obj = self._ref()
        if obj is not None:
            self.logger.log(self.level, "%s", summary_line(obj))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if self._ref() is None:
                return
            try:
                self.log_now()
            except Exception:  # a summary must never take the job down
                self.logger.debug("asynccache summary failed", exc_info=True)

    def stop(self, *, final: bool = False) -> None:
        """Stop the timer (``final``: log one last line first). In a forked child, where
        the timer never ran, it does nothing."""
        if self._generation != _fork.generation:
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if final:
            self.log_now()

    def __enter__(self) -> SummaryLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def log_summary(obj: Any, every: float = 60.0, logger: logging.Logger | None = None,
                level: int = logging.INFO) -> SummaryLogger:
    """Start logging ``obj``'s one-line summary (`summary_line()`) every ``every`` seconds.

    Args:
        obj: an `AsyncKVCache`, a pipe or a `CachedMapper` (held weakly).
        every: seconds between lines.
        logger: where to log (default: ``asynccache.summary``).
        level: the level of the lines.

    Returns:
        The `SummaryLogger`: ``.stop()`` it, or use it as a context manager.
    """
    return SummaryLogger(obj, every, logger, level)
