"""Counters of every copy of one pipe or node, across the processes of a job.

Why it is built this way: docs/design.md, "The stats board".
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import multiprocessing.util
import os
import re
import stat
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .. import _fork
from . import counts_file
from .counts_file import CountsFile

_T = TypeVar("_T")

__all__ = ["COUNTS_SUFFIX", "ENV_DIR", "META_FILE", "REPORT_INTERVAL", "StatsBoard", "boards_root"]

logger = logging.getLogger("asynccache")

#: Seconds between two reports of one process (the "at most about a second old").
REPORT_INTERVAL = 1.0
_STALE_AFTER = 24 * 3600
#: The board's label (namespace, owner pid); not ``*.json``, so collect() never reads it.
META_FILE = "board.meta"
#: The shared directory the boards' directory is made in (default /dev/shm, else $TMPDIR).
ENV_DIR = "ASYNCCACHE_STATS_DIR"
#: A process's counters: ``<pid>.counts`` (see `asynccache.observe.counts_file`).
COUNTS_SUFFIX = ".counts"
#: Files of ours are a few hundred bytes; anything much larger is not one.
_MAX_FILE = 1 << 20
#: Board ids: what ``secrets.token_hex`` makes (pipes and nodes), or a test's name.
_BOARD_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
#: What the sweep may delete: the names pipes and nodes give their boards.
_SWEPT_ID = re.compile(r"[0-9a-f]{16}")
_LOG_KIND = re.compile(r"[^A-Za-z0-9_.-]")

_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)
_O_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) \
    | getattr(os, "O_NONBLOCK", 0)
_O_COUNTS = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)
_O_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)
_SAFE_PLATFORM = (hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY")
                  and os.open in os.supports_dir_fd and os.scandir in os.supports_fd)


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process with that pid: not ours, but alive
        return True
    return True


def _base_dir() -> Path:
    chosen = os.environ.get(ENV_DIR)
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def boards_root() -> Path:
    """The directory of this user's boards on this machine (it may not exist yet)."""
    return _base_dir() / f"asynccache-stats-{os.geteuid()}"


# -- the verified root ------------------------------------------------------------------------
#: root path -> why boards are off for it in this process (inherited by forked children,
#: which then stay quiet too: one warning per job, not per worker)
_refused: dict[str, str] = {}


def _unsafe(st: os.stat_result) -> str | None:
    """Why a directory with this ``lstat``/``fstat`` is not one to trust, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return (f"is writable by its group or by others (mode "
                f"{stat.S_IMODE(st.st_mode):04o})")
    return None


def _refuse(path: str, reason: str) -> None:
    if path in _refused:
        return
    _refused[path] = reason
    logger.warning(
        "asynccache: stats boards are off in this process: %s %s, so it is not used "
        "(it could let another user read, plant or delete files). stats() of pipes and "
        "nodes now counts this process only (not its DataLoader workers), and store "
        "failures are logged once per process instead of once per job. If that directory "
        "is yours, remove it (rm -r %s): asynccache makes it again, mode 0700; if it is "
        "not, set %s to a directory of your own", path, reason, path, ENV_DIR)


@contextlib.contextmanager
def _root(create: bool) -> Iterator[int | None]:
    """A file descriptor of this user's verified boards directory, or None (absent and not
    ``create``, unusable, or refused: then boards are off, see `_refuse()`)."""
    path = str(boards_root())
    if path in _refused:
        yield None
        return
    if not _SAFE_PLATFORM:
        _refuse(path, "cannot be used safely on this platform (no O_NOFOLLOW / dir_fd)")
        yield None
        return
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:  # a read-only or full /dev/shm: no boards, nothing to warn about
            yield None
            return
    try:
        before = os.lstat(path)
    except OSError:
        yield None  # not made yet: nothing to read
        return
    reason = _unsafe(before)
    fd = -1
    if reason is None:
        try:
            fd = os.open(path, _O_DIR)
        except OSError as exc:
            reason = f"cannot be opened without following a link ({exc.strerror})"
        else:
            after = os.fstat(fd)
            if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
                reason = "was replaced while it was being checked"
            else:
                reason = _unsafe(after)
    if reason is not None:
        if fd >= 0:
            os.close(fd)
        _refuse(path, reason)
        yield None
        return
    if stat.S_IMODE(before.st_mode) & 0o077:
        # ours, not a link, nobody else may write it: only readable by others (made by an
        # older release under umask 022). Ours to close, through the verified descriptor.
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o700)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _subdir(parent: int | None, name: str, create: bool = False) -> Iterator[int | None]:
    """``name`` inside the directory ``parent`` (opened without following a link), or
    None when ``parent`` is None or ``name`` is not there (and not ``create``)."""
    if parent is None:
        yield None
        return
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _O_DIR, dir_fd=parent)
    except FileNotFoundError:
        yield None
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link or a file where a dir was
            yield None
            return
        raise
    try:
        yield fd
    finally:
        os.close(fd)


def _write(directory: int, name: str, data: bytes) -> None:
    """Replace ``name`` in ``directory`` atomically (readers never see half a file)."""
    partial = f".{os.getpid()}.{name}.tmp"
    fd = os.open(partial, _O_WRITE, 0o600, dir_fd=directory)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(partial, name, src_dir_fd=directory, dst_dir_fd=directory)


def _in_regular_file(directory: int, name: str, read: Callable[[int], _T]) -> _T | None:
    """``read(fd)`` of the regular file ``name`` (never through a link), or None when it
    is not one or cannot be read."""
    try:
        fd = os.open(name, _O_READ, dir_fd=directory)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return read(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read(directory: int, name: str) -> bytes | None:
    """The content of the regular file ``name`` (never through a link), or None."""
    data = _in_regular_file(directory, name, lambda fd: os.read(fd, _MAX_FILE + 1))
    return data if data is not None and len(data) <= _MAX_FILE else None


def _remove_tree(parent: int, name: str) -> None:
    """Delete the directory ``name`` of ``parent`` and what it holds; a symbolic link is
    removed as a link, never followed."""
    try:
        fd = os.open(name, _O_DIR, dir_fd=parent)
    except OSError:
        return  # gone, or not a directory (a link is never followed)
    try:
        with os.scandir(fd) as entries:
            for entry in list(entries):
                if entry.is_dir(follow_symlinks=False):
                    _remove_tree(fd, entry.name)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=fd)
    except OSError:
        pass
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent)


def _counts(directory: int, name: str) -> dict[str, int] | None:
    """The counters in the regular file ``name`` (never through a link), or None."""
    return _in_regular_file(directory, name, lambda fd: counts_file.read(fd, _MAX_FILE))


def _rows(data: bytes | None) -> dict[str, list[int]] | None:
    """A latency file's ``{kind: [int, ...]}``, or None when it is not one."""
    try:
        found = json.loads(data) if data is not None else None
    except ValueError:
        return None
    if not isinstance(found, dict) or not all(
            isinstance(k, str) and isinstance(row, list) and all(type(v) is int for v in row)
            for k, row in found.items()):
        return None
    return found


# -- boards this process owns: removed when it exits ---------------------------------------
_owned: dict[str, StatsBoard] = {}
_hooked = -1  # the fork generation the exit hook was registered in


def _own(board: StatsBoard) -> None:
    global _hooked
    _owned[board.board_id] = board
    if _hooked != _fork.generation:
        # a forked multiprocessing child leaves through os._exit: atexit does not run
        # there, multiprocessing's finalizers do (this one after the loop's, 100)
        _hooked = _fork.generation
        multiprocessing.util.Finalize(None, _remove_owned, exitpriority=10)


def _remove_owned() -> None:
    for board in list(_owned.values()):
        board.remove()


atexit.register(_remove_owned)
# a forked child does not own its parent's boards
_fork.at_fork(in_child=_owned.clear)


class StatsBoard:
    """Where the copies of one pipe or node publish their counters."""

    def __init__(self, board_id: str) -> None:
        if not _BOARD_ID.fullmatch(board_id):
            raise ValueError(f"not a board id: {board_id!r}")
        self.board_id = board_id
        self.root = boards_root()
        self.directory = self.root / board_id
        #: files of this board that did not parse (ignored), seen by this object
        self.errors = 0
        #: (pid, this process's counts file in the board, or None: no board to write to)
        #: opened through the verified directory by the first `publish()`: a worker that
        #: publishes with every batch checks the root once, not each time (~0.1 ms)
        self._held: tuple[int, CountsFile | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_held"] = None  # a descriptor of this process
        return state

    def _counts_file(self) -> CountsFile | None:
        held = self._held
        if held is not None and held[0] == os.getpid():
            return held[1]
        found: CountsFile | None = None
        with self._directory() as fd:
            if fd is not None:
                kept = os.open(f"{os.getpid()}{COUNTS_SUFFIX}", _O_COUNTS, 0o600, dir_fd=fd)
                if stat.S_ISREG(os.fstat(kept).st_mode):
                    found = CountsFile(kept)
                    weakref.finalize(self, _close_quietly, kept, os.getpid())
                else:
                    os.close(kept)
        # once the owner removed its board it never makes it again: a copy stops looking
        self._held = (os.getpid(), found)
        return found

    def _ignored(self, name: str) -> None:
        self.errors += 1
        logger.debug("asynccache: ignoring %s in stats board %s: not a file asynccache "
                     "wrote", name, self.directory)

    @contextlib.contextmanager
    def _directory(self, create: bool = False) -> Iterator[int | None]:
        """This board's directory (verified root; ``create``: made, root included)."""
        with _root(create) as root, _subdir(root, self.board_id, create) as fd:
            yield fd

    def exists(self) -> bool:
        """The board is there (its owner has not removed it), in a verified root."""
        with self._directory() as fd:
            return fd is not None

    def publish(self, counters: dict[str, int]) -> None:
        """Write this process's counters (in place, a few µs: readers never see half of
        them; see `asynccache.observe.counts_file`). Only into an existing board: copies
        never make one (the owner did, in `label()`; once it removed it, a late report
        must not bring it back)."""
        counts = self._counts_file()
        if counts is not None:
            counts.write(counters)

    def collect(self) -> dict[int, dict[str, int]]:
        """The latest counters of every other process that published, by pid. A file that
        does not parse as counters is ignored (counted in `errors`)."""
        found: dict[int, dict[str, int]] = {}
        own = os.getpid()
        with self._directory() as fd:
            if fd is None:
                return found
            for name in _names(fd):
                stem, dot, ext = name.partition(".")
                if dot + ext != COUNTS_SUFFIX or not stem.isdigit() or int(stem) == own:
                    continue
                counters = _counts(fd, name)
                if counters is None:
                    self._ignored(name)
                else:
                    found[int(stem)] = counters
        return found

    # -- for a process outside the job (``asynccache stats``) -------------------------------
    def label(self, namespace: str | None) -> None:
        """Make the board (this process owns it: it is removed when this process exits)
        and record which namespace it counts for and which process owns it, so a process
        that did not build the pipe can find the boards of a namespace."""
        with self._directory(create=True) as fd:
            if fd is None:
                return  # boards are off: stats() counts this process only
            _own(self)
            _write(fd, META_FILE, json.dumps({"namespace": namespace,
                                              "owner": os.getpid()}).encode())

    def metadata(self) -> dict[str, Any] | None:
        """What `label()` recorded, or None (an unlabelled or vanished board)."""
        with self._directory() as fd:
            return None if fd is None else _meta(fd)

    @classmethod
    def labelled(cls, namespace: str) -> list[StatsBoard]:
        """This user's boards on this machine labelled with ``namespace`` whose owner
        process is still running (a crashed job's board is not current)."""
        boards: list[StatsBoard] = []
        with _root(create=False) as root:
            if root is None:
                return boards
            for name in sorted(_names(root)):
                if not _BOARD_ID.fullmatch(name):
                    continue
                with _subdir(root, name) as fd:
                    meta = None if fd is None else _meta(fd)
                if meta is not None and meta.get("namespace") == namespace \
                        and _alive(meta.get("owner")):
                    boards.append(cls(name))
        return boards

    def remove(self) -> None:
        """Delete the board (never through a link); this process no longer owns it."""
        _owned.pop(self.board_id, None)
        with _root(create=False) as root:
            if root is not None:
                _remove_tree(root, self.board_id)

    def sweep(self) -> None:
        """Remove boards left behind by jobs that did not exit cleanly: over a day old,
        their owner gone. Only what is provably a board of ours: a directory (not a
        link) owned by this user, named as pipes and nodes name boards, with a label."""
        now = time.time()
        me = os.geteuid()
        with _root(create=False) as root:
            if root is None:
                return
            try:
                with os.scandir(root) as scan:
                    entries = list(scan)
            except OSError:
                return
            for entry in entries:
                if entry.name == self.board_id or not _SWEPT_ID.fullmatch(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != me \
                        or now - st.st_mtime <= _STALE_AFTER:
                    continue
                with _subdir(root, entry.name) as fd:
                    meta = None if fd is None else _meta(fd)
                if meta is None or _alive(meta.get("owner")):
                    continue
                _remove_tree(root, entry.name)

    # -- latency histograms and job-wide "log once" (asynccache.metrics) ----------------
    # Kept in subdirectories, so ``collect`` (``*.json`` at the top) never sees them.

    def publish_latency(self, rows: dict[str, list[int]]) -> None:
        """Write this process's latency histograms (``Latency.to_row()`` per kind)."""
        with self._directory() as board, _subdir(board, "latency", create=True) as fd:
            if fd is not None:
                _write(fd, f"{os.getpid()}.json", json.dumps(rows).encode())

    def collect_latency(self) -> dict[int, dict[str, list[int]]]:
        """The latest histograms of every other process that published, by pid."""
        found: dict[int, dict[str, list[int]]] = {}
        own = os.getpid()
        with self._directory() as board, _subdir(board, "latency") as fd:
            if fd is None:
                return found
            for name in _names(fd):
                stem, _, ext = name.partition(".")
                if ext != "json" or not stem.isdigit():
                    continue
                rows = _rows(_read(fd, name))
                if rows is None:
                    self._ignored(f"latency/{name}")
                elif int(stem) != own:
                    found[int(stem)] = rows
        return found

    def claim(self, kind: str) -> bool:
        """True for the first process of the job to claim ``kind`` (a failure to log).

        A marker file created with ``O_EXCL``: exactly one process wins, however many
        DataLoader workers (or epochs of fresh workers) hit the same failure. When the
        board cannot be written (or boards are off) the answer is True: logging once per
        process beats trusting markers someone else could have planted.
        """
        name = _LOG_KIND.sub("_", kind)[:200] or "_"
        try:
            with self._directory() as board, _subdir(board, "logged", create=True) as fd:
                if fd is None:
                    return True
                os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _O_READ,
                                 0o600, dir_fd=fd))
        except FileExistsError:
            return False
        except OSError:
            return True
        return True


def _close_quietly(fd: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits the finalizer, not the descriptor's use
        with contextlib.suppress(OSError):
            os.close(fd)


def _names(directory: int) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _meta(directory: int) -> dict[str, Any] | None:
    try:
        found = json.loads(_read(directory, META_FILE) or b"")
    except ValueError:
        return None
    return found if isinstance(found, dict) else None
