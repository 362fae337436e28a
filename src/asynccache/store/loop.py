"""One event loop per process, in a daemon thread, for the synchronous integrations.

Why not one loop per object: every asyncio connection belongs to the loop that made it,
so sharing one loop lets every pipe in a process share connections. After ``fork`` the
child inherits the parent's ``LoopThread`` object but not its thread, so
`get_loop_thread()` builds a new one when the fork generation moved on. Why not
``anyio.from_thread.start_blocking_portal``: the hot path needs only
``call_soon_threadsafe`` (one per batch) and ``run_coroutine_threadsafe``; a portal adds
a layer per call without adding anything we use (see the issue notes).

Shutdown runs at interpreter exit (``atexit``) and at multiprocessing worker exit
(``multiprocessing.util.Finalize``: forked DataLoader workers leave through
``os._exit`` and skip ``atexit``), first running registered shutdown hooks (pipes flush
their write-behind queues) and then stopping the loop, each step bounded in time.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import multiprocessing.util
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .. import _fork
from ..errors import LoopError

__all__ = ["LoopThread", "get_loop_thread"]

T = TypeVar("T")
logger = logging.getLogger("asynccache")

_lock = threading.Lock()
_current: LoopThread | None = None


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when importable (faster I/O and call_soon_threadsafe), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop running forever in a daemon thread of this process."""

    def __init__(self, name: str = "asynccache-loop") -> None:
        self.generation = _fork.generation
        self.loop = _new_event_loop()
        self._hooks: weakref.WeakSet[Any] = weakref.WeakSet()
        self._ready = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        self.closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def check_caller(self) -> None:
        """Raise LoopError when called from this loop's own thread."""
        if self.in_loop_thread():
            raise LoopError(
                "the synchronous asynccache API was called from asynccache's own loop thread, "
                "which would deadlock; inside async code use AsyncKVCache directly"
            )

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; cancel the returned future to cancel it."""
        try:
            self.check_caller()
        except LoopError:
            coro.close()  # never scheduled: close it so it is not reported as un-awaited
            raise
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` s).

        Safe against an exception raised in the caller at any moment (a signal handler's,
        ``KeyboardInterrupt``): the coroutine is cancelled and the loop thread never
        waits on a lock the caller may have been holding (see `_Call`)."""
        try:
            self.check_caller()
        except LoopError:
            coro.close()
            raise
        return _Call(self.loop, coro).result(timeout)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread soon (thread-safe, does not wait)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def add_shutdown_hook(self, owner: Any) -> None:
        """``owner._on_loop_shutdown()`` runs (in the caller's thread) before the loop stops."""
        self._hooks.add(owner)

    def stop(self, timeout: float = 5.0) -> None:
        """Run shutdown hooks, cancel what is left, stop and join the thread."""
        if self.closed or self._stopping or self.generation != _fork.generation:
            return
        self._stopping = True  # hooks may still use the loop; new users get a new one
        for owner in list(self._hooks):
            try:
                owner._on_loop_shutdown()
            except Exception:  # a failing hook must not keep the others from running
                logger.exception("asynccache: shutdown hook of %r failed", owner)
        self.closed = True
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("asynccache: loop tasks did not finish within %.1fs", timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


class _Call:
    """One coroutine run on the loop for a waiting thread.

    ``concurrent.futures.Future`` would do, but its result() waits on a Condition that
    the loop thread acquires to set the result: an exception raised in the waiting thread
    while it re-acquires that lock (a signal handler's, at any bytecode) releases it under
    the loop thread's feet. Here the loop thread only ever *releases* a plain lock the
    waiter acquires, which never blocks the loop and leaves nothing half-held. A waiter
    that leaves early (timeout, interrupt) cancels the coroutine.
    """

    __slots__ = ("cancelled", "coro", "done", "loop", "outcome", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> None:
        self.loop, self.coro = loop, coro
        self.done = threading.Lock()
        self.done.acquire()
        self.task: asyncio.Task[Any] | None = None
        self.outcome: asyncio.Task[Any] | None = None
        self.cancelled = False
        try:
            loop.call_soon_threadsafe(self._start)
        except BaseException:  # never scheduled (a closed loop, an interrupt)
            coro.close()
            raise

    def _start(self) -> None:  # loop thread
        if self.cancelled:
            self.coro.close()
            self.done.release()
            return
        self.task = self.loop.create_task(self.coro)
        self.task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:  # loop thread
        self.outcome = task
        self.done.release()

    def _cancel(self) -> None:  # loop thread
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()

    def result(self, timeout: float | None) -> Any:
        try:
            if not self.done.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
                raise concurrent.futures.TimeoutError()
        except BaseException:
            self.loop.call_soon_threadsafe(self._cancel)
            raise
        outcome = self.outcome
        if outcome is None or outcome.cancelled():  # e.g. by the loop's shutdown
            raise concurrent.futures.CancelledError()
        return outcome.result()


async def _cancel_all() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def get_loop_thread() -> LoopThread:
    """This process's loop thread, started on first use and after a fork."""
    global _current
    current = _current
    if current is not None and current.generation == _fork.generation and not current.closed:
        return current
    with _lock:
        current = _current
        if current is None or current.generation != _fork.generation or current.closed:
            if current is not None and current.generation != _fork.generation:
                _fork.park_inherited(current)  # the parent's loop: never run, close or free it here
            current = _current = LoopThread()
            _register_exit_hook()
    return current


_hooked = -1  # the fork generation the exit hook was registered in


def _register_exit_hook() -> None:
    """Once per process: stop the current loop when a multiprocessing child exits.

    Not tied to a LoopThread object: a finalizer bound to an old loop would run when
    that object is collected and stop its replacement.
    """
    global _hooked
    if _hooked != _fork.generation:
        _hooked = _fork.generation
        multiprocessing.util.Finalize(None, _shutdown, exitpriority=100)


def _shutdown() -> None:
    current = _current
    if current is not None and current.generation == _fork.generation:
        current.stop()


def _after_fork_in_child() -> None:
    # The inherited lock may have been held by another thread at fork time.
    global _lock
    _lock = threading.Lock()


atexit.register(_shutdown)
_fork.at_fork(in_child=_after_fork_in_child)
