"""This process' LMDB environments, one per path, closed across ``fork``, and its one
writer thread (docs/design.md, "LMDB", says why)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ... import _fork
from ...errors import StoreUnavailable
from .damage import DAMAGE, Env, EnvironmentDamaged, damaged, file_problem
from .package import lmdb

__all__ = ["FORK_WAIT", "Settings", "in_use", "session", "using", "writer"]


@dataclass(frozen=True)
class Settings:
    path: str
    map_size: int
    max_readers: int
    max_spare_txns: int
    sync: bool
    readahead: bool
    verify: bool


#: How long a fork waits for this process' LMDB operations in flight to finish, so that
#: it can close the environments first (see _before_fork).
FORK_WAIT = 10.0


class _Process:
    """This process' environments (by real path), the threads using them, its writer
    thread.

    What a fork waits for is a set of *threads* inside an operation, not a count: an
    exception raised by a signal handler (Ctrl-C, a SIGTERM or SIGALRM handler) can land
    between marking an operation and the ``try`` that unmarks it, and a count would stay
    up for the life of the process, so that every later fork waited ``FORK_WAIT`` for an
    operation that had ended. A thread's mark can be checked: a thread is never inside
    two operations, so a mark found when it begins another, or on the thread that is
    forking (it is calling ``fork``, not LMDB), or on a thread that has ended, is left
    over by an interrupt; it is dropped and counted (`repaired`). Python runs signal
    handlers in the main thread only, so only its mark can be left over, and it forks
    the DataLoader workers.
    """

    def __init__(self) -> None:
        self.envs: dict[str, Env] = {}
        self.writer: concurrent.futures.ThreadPoolExecutor | None = None
        #: taken with ``with proc.lock`` (a C-level enter: an exception raised by a signal
        #: handler cannot land between acquiring it and the block, as it can inside
        #: ``Condition.__enter__``, which would leave it held for ever); ``idle`` waits on it
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        #: idents of the threads between begin and end of a transaction
        self.active: set[int] = set()
        self.forking = False    # a fork is closing the environments: wait
        #: marks found left over by an interrupt and dropped (see the class docstring)
        self.repaired = 0

    def busy(self) -> set[int]:  # locked
        """The threads a fork must wait for; left-over marks dropped on the way."""
        me = threading.get_ident()
        alive = {thread.ident for thread in threading.enumerate()}
        stale = {ident for ident in self.active if ident == me or ident not in alive}
        if stale:
            self.active -= stale
            self.repaired += len(stale)
        return self.active


_process = _Process()


def _before_fork() -> None:
    """Close every environment before the process forks, once no operation is using one.

    A forked child must not use its parent's environment (its reader slots carry the
    parent's pid, and it holds none of the parent's file locks), must not close it
    either (aborting the inherited transactions would free reader slots the parent
    still uses), and py-lmdb refuses to open the same files again while it is open.
    So the parent closes them here (new operations wait), the child starts with none,
    and both reopen on first use. If operations are still running after ``FORK_WAIT``
    seconds the environments stay open, and the child's LMDB operations fail (counted
    store errors: values are computed).
    """
    proc = _process
    if not proc.envs:
        return
    with proc.lock:
        proc.forking = True
        deadline = time.monotonic() + FORK_WAIT
        while proc.busy() and (left := deadline - time.monotonic()) > 0:
            proc.idle.wait(left)
        if not proc.active:
            for held in proc.envs.values():
                held.close()
            proc.envs.clear()


def _after_fork_in_parent() -> None:
    proc = _process
    if proc.forking:
        with proc.lock:
            proc.forking = False
            proc.idle.notify_all()


def _after_fork_in_child() -> None:
    global _process
    _fork.park_inherited(_process)  # its lock may be held, its thread is gone
    _process = _Process()


_fork.at_fork(before=_before_fork, in_parent=_after_fork_in_parent, in_child=_after_fork_in_child)


@contextlib.contextmanager
def session(settings: Settings, where: str) -> Iterator[Env]:
    """This process' environment for ``settings.path``, opened on first use and checked
    (`Env.check()`) each time, counted as in use (a fork waits) until the block
    ends: begin and end transactions inside it. LMDB's reports of damage inside the
    block become an `EnvironmentDamaged`, and the environment is not used again
    in this process."""
    proc = _process
    me = threading.get_ident()
    with proc.lock:
        while proc.forking:
            proc.idle.wait()
        held = proc.envs.get(settings.path)
        if held is None:
            held = proc.envs[settings.path] = _open(settings, where)
        if me in proc.active:  # left over by an interrupted operation of this thread
            proc.repaired += 1
        proc.active.add(me)
    try:
        held.check()
        yield held
    except DAMAGE as exc:
        raise held.fail(f"LMDB found it inconsistent ({type(exc).__name__}: {exc})") from exc
    finally:
        with proc.lock:
            proc.active.discard(me)
            if not proc.active and proc.forking:
                proc.idle.notify_all()


@contextlib.contextmanager
def using(settings: Settings, where: str) -> Iterator[Any]:
    """Like `session()`, yielding only the ``lmdb.Environment``."""
    with session(settings, where) as held:
        yield held.env


def _open(settings: Settings, where: str) -> Env:
    try:
        os.makedirs(settings.path, exist_ok=True)
        env = lmdb.open(settings.path, map_size=settings.map_size,
                        max_readers=settings.max_readers,
                        max_spare_txns=settings.max_spare_txns, sync=settings.sync,
                        metasync=settings.sync, readahead=settings.readahead, lock=True,
                        subdir=True, create=True)
    except (OSError, lmdb.Error) as exc:
        if "already open in this process" in str(exc):
            raise StoreUnavailable(
                f"LMDB {where}: this process was forked while its parent was still using "
                f"the environment (for over {FORK_WAIT:g}s), so it cannot open it; start "
                "DataLoader workers with multiprocessing_context='spawn' or 'forkserver', "
                "or fork while no LMDB write is pending") from exc
        problem = file_problem(settings.path)
        if problem is not None or isinstance(exc, DAMAGE):
            raise EnvironmentDamaged(damaged(
                where, settings.path, problem or f"LMDB refused to open it "
                f"({type(exc).__name__}: {exc})")) from exc
        raise StoreUnavailable(
            f"cannot open the LMDB environment {where}: {exc}; check that the directory "
            "exists or can be created, and that this user may write it (LMDB needs write "
            "access for its lock file even to read)") from exc
    try:
        env.reader_check()  # reader slots of processes that died (a killed worker)
    except lmdb.Error:
        pass
    try:
        held = Env(env, settings.path, where)
        if settings.verify:
            held.verify()
        return held
    except OSError as exc:
        env.close()
        raise StoreUnavailable(f"LMDB {where}: cannot open data.mdb to check it: {exc}; "
                               "check the directory's permissions") from exc


def in_use() -> tuple[int, int]:
    """(threads inside an LMDB operation now, left-over marks repaired so far), for tests
    and diagnostics."""
    proc = _process
    with proc.lock:
        return len(proc.active), proc.repaired


def writer() -> concurrent.futures.ThreadPoolExecutor:
    proc = _process
    if proc.writer is None:
        with proc.lock:
            if proc.writer is None:
                proc.writer = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="asynccache-lmdb-writer")
    return proc.writer
