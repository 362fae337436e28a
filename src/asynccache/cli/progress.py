"""Progress on stderr for the long commands (`demo`, `bench`, `warm`).

A bar when stderr is a terminal: tqdm's when tqdm is installed (it is optional: the
`demo` and `bench` extras bring it), else a counter rewritten in place. Nothing with
`--no-progress` or when stderr is not a terminal (a log file gets no carriage returns);
`bench` then writes one plain line per stage instead (`log_stages=True`), so a log shows
where a long run is.

Why one object owns every line written while its bar is shown: a bar is the last line
of the terminal, redrawn in place, and anything else written meanwhile -- a message, a
warning, a log record -- would land right after the bar's text on the same line
(`warm: 512/3,000 itemsasynccache warm: item 1234 failed`). So while a bar is open,
`sys.stdout`, `sys.stderr` and the logging handlers that write to them go through
`Progress.write`: clear the bar, write the whole line, draw the bar again below it.
Processes forked meanwhile (DataLoader workers) inherit the redirection but write
straight through: the bar is not theirs to redraw. Worker processes whose messages
matter hand them to the parent instead (`warm` does).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from types import TracebackType
from typing import Any, Protocol, TextIO

__all__ = ["Progress", "tqdm_available"]

#: seconds between two redraws of the fallback counter
REDRAW = 0.2


def tqdm_available() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _real(stream: Any) -> Any:
    """The stream behind one of our redirections (the stream itself otherwise)."""
    return getattr(stream, "real_stream", stream)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class _Display(Protocol):
    """What a bar implementation does: tqdm's own method names."""

    total: float | None
    n: float

    def update(self, n: float = 1) -> Any: ...
    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...
    def clear(self, nolock: bool = False) -> None: ...
    def refresh(self, nolock: bool = False, lock_args: Any = None) -> None: ...
    def close(self) -> None: ...


class _Counter:
    """The bar without tqdm: `desc: 512/3,000 items (status)` rewritten in place."""

    def __init__(self, total: float | None, desc: str, unit: str, file: TextIO) -> None:
        self.total = total
        self.n: float = 0
        self.desc = desc
        self.unit = unit
        self.postfix = ""
        self.file = file
        self.drawn = 0.0
        self.refresh()

    def update(self, n: float = 1) -> None:
        self.n += n
        if time.monotonic() - self.drawn >= REDRAW or self.n == self.total:
            self.refresh()

    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""
        if refresh:
            self.refresh()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        if refresh:
            self.refresh()

    def clear(self, nolock: bool = False) -> None:
        self.file.write("\r\x1b[K")
        self.file.flush()

    def refresh(self, nolock: bool = False, lock_args: Any = None) -> None:
        done = f"{self.n:,.0f}" + (f"/{self.total:,.0f}" if self.total else "")
        status = f" ({self.postfix})" if self.postfix else ""
        head = f"{self.desc}: " if self.desc else ""
        self.file.write(f"\r\x1b[K{head}{done} {self.unit}s{status}")
        self.file.flush()
        self.drawn = time.monotonic()

    def close(self) -> None:
        self.clear()


def _tqdm_display(total: float | None, desc: str, unit: str, file: TextIO) -> _Display:
    from tqdm import tqdm

    class Bar(tqdm):
        # no monitor thread: it would be alive in every process forked while it runs
        monitor_interval = 0

    bar: _Display = Bar(total=total or None, desc=desc, unit=unit, file=file, leave=False,
                        dynamic_ncols=True)
    return bar


class _LineRouter:
    """A stand-in for `sys.stdout` / `sys.stderr` while a bar is shown: whole lines go
    through `Progress.write`; in a forked child, everything goes straight through."""

    def __init__(self, progress: Progress, real: TextIO) -> None:
        self.progress = progress
        self.real_stream = real
        self.pending = ""
        self.owner = os.getpid()

    def write(self, text: str) -> int:
        if os.getpid() != self.owner:
            return self.real_stream.write(text)
        self.pending += text
        if "\n" in self.pending:
            lines, _, self.pending = self.pending.rpartition("\n")
            self.progress.write(lines, file=self.real_stream)
        return len(text)

    def flush(self) -> None:
        # A partial line stays pending: written now, it would be glued to the bar.
        self.real_stream.flush()

    def drain(self) -> None:
        if self.pending:
            self.real_stream.write(self.pending)
            self.pending = ""
        self.real_stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.real_stream, name)


class Progress:
    """One progress display: a bar with a description, a count, and a status.

    `enabled=False` (`--no-progress`) shows nothing; otherwise a bar appears when `file`
    (stderr) is a terminal. `log_stages`: when no bar can be shown but progress was
    wanted, write each new description as a line of its own. Use it as a context
    manager, or call `close()`; messages go through `write()`.
    """

    def __init__(
        self,
        total: float | None = None,
        desc: str = "",
        *,
        unit: str = "it",
        enabled: bool = True,
        log_stages: bool = False,
        file: TextIO | None = None,
    ) -> None:
        self.file: TextIO = _real(file if file is not None else sys.stderr)
        self.desc = desc
        self.status = ""
        self.shown = enabled and _is_terminal(self.file)
        self.log_stages = enabled and log_stages and not self.shown
        self.lock = threading.RLock()
        self.display: _Display | None = None
        self._restore: list[Any] = []
        if self.shown:
            if tqdm_available():
                self.display = _tqdm_display(total, desc, unit, self.file)
            else:
                self.display = _Counter(total, desc, unit, self.file)
            self._redirect()
        elif self.log_stages and desc:
            self._log(desc)

    # ---------------------------------------------------------------------- counting

    @property
    def total(self) -> float | None:
        return self.display.total if self.display is not None else None

    def add_total(self, n: float) -> None:
        """More work found (a benchmark learns its cases as it goes)."""
        if self.display is None:
            return
        with self.lock:
            self.display.total = (self.display.total or 0) + n
            self.display.refresh()

    def update(self, n: float = 1) -> None:
        if self.display is not None:
            with self.lock:
                self.display.update(n)

    def describe(self, desc: str) -> None:
        """What is being done now (a module and its stage, an epoch)."""
        if desc == self.desc:
            return
        self.desc = desc
        if self.display is not None:
            with self.lock:
                self.display.set_description_str(desc)
        elif self.log_stages:
            self._log(desc)

    def set_status(self, status: str) -> None:
        """A detail after the count: `warm-up`, `rep 3/7`."""
        if status == self.status:
            return
        self.status = status
        if self.display is not None:
            with self.lock:
                self.display.set_postfix_str(status)

    def rep(self, done: int, reps: int) -> None:
        """The repetition under way: 0 is the warm-up."""
        self.set_status("warm-up" if done == 0 else f"rep {done}/{reps}")

    # ---------------------------------------------------------------------- messages

    def write(self, text: str, file: TextIO | None = None) -> None:
        """`text` as whole lines on `file` (stdout by default, as `print`), never on the
        bar's line: the bar is cleared first and drawn again after."""
        target = _real(file if file is not None else sys.stdout)
        with self.lock:
            if self.display is not None:
                self.display.clear()
            target.write(text + "\n")
            target.flush()
            if self.display is not None:
                self.display.refresh()

    def _log(self, desc: str) -> None:
        self.file.write(f"{desc}...\n")
        self.file.flush()

    # --------------------------------------------------------------- redirections

    def _redirect(self) -> None:
        """Route stdout, stderr and logging's stream handlers through `write`."""
        routers: dict[int, _LineRouter] = {}
        for name in ("stdout", "stderr"):
            current = getattr(sys, name)
            if isinstance(current, _LineRouter):  # another bar is already routing
                continue
            router = _LineRouter(self, current)
            routers[id(current)] = router
            setattr(sys, name, router)
            self._restore.append((sys, name, current, router))
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for handler in getattr(logger, "handlers", ()):
                if isinstance(handler, logging.StreamHandler) \
                        and id(handler.stream) in routers:
                    stream = handler.stream
                    handler.setStream(routers[id(stream)])
                    self._restore.append((handler, None, stream, None))

    def _undo_redirect(self) -> None:
        for owner, name, original, router in reversed(self._restore):
            if name is None:
                owner.setStream(original)
                continue
            if getattr(owner, name) is router:
                setattr(owner, name, original)
            router.drain()
        self._restore.clear()

    def close(self) -> None:
        with self.lock:
            if self.display is not None:
                self.display.close()
                self.display = None
            self._undo_redirect()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
