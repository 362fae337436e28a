"""The interface every store client implements, and the per-loop connection plumbing.

A client is a *configuration object*: it holds the URL's settings and opens connections
lazily, in the process and event loop that first uses it. asyncio connections belong to
one loop (redis-py #2838, #3351) and do not survive ``fork`` (redis-py #2910, #3141), so
the live connection state is kept per ``(pid, loop)`` and dropped when pickled. That is
what lets one client object be handed to DataLoader workers under fork, spawn or
forkserver, and be used both from an async service's loop and from asynccache's own
loop thread.

Bytes in, bytes out: keys are ``bytes``, values are ``bytes``; a missing key is ``None``.
Every operation is bounded by ``timeout`` seconds and raises only
:class:`~asynccache.errors.StoreError` subclasses for store trouble.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from .._fork import park_inherited
from ..errors import StoreTimeout

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "DEFAULT_TIMEOUT", "BaseClient"]

DEFAULT_TIMEOUT = 1.0
DEFAULT_CONNECT_TIMEOUT = 1.0
DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_CONNECTIONS = 8

StateT = TypeVar("StateT")
T = TypeVar("T")


class BaseClient(ABC, Generic[StateT]):
    """Common configuration, lazy per-loop state, pickling and timeouts.

    Subclasses implement ``_open_state`` (build the library client for the running loop,
    without network I/O), ``_close_state`` and the four operations.
    """

    scheme: ClassVar[str]
    #: Largest value the store accepts in one item; ``None`` means "no practical limit".
    max_value_size: int | None = None

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_batch = int(max_batch)
        self.max_connections = int(max_connections)
        self._init_runtime()

    # -- runtime state ------------------------------------------------------------------
    def _init_runtime(self) -> None:
        self._pid = os.getpid()
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StateT] = (
            weakref.WeakKeyDictionary()
        )
        self._users: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = (
            weakref.WeakKeyDictionary()
        )

    def _forked(self) -> bool:
        """True (and the inherited state parked) in a forked child: its sockets are not ours."""
        if self._pid == os.getpid():
            return False
        park_inherited((self._states, self._users))
        self._init_runtime()
        return True

    def _state(self) -> StateT:
        """The connection state for the running loop, created on first use."""
        self._forked()
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            state = self._open_state()
            self._states[loop] = state
        return state

    @abstractmethod
    def _open_state(self) -> StateT:
        """Create the per-loop client objects (no network I/O here)."""

    @abstractmethod
    async def _close_state(self, state: StateT) -> None:
        """Close what ``_open_state`` created."""

    async def close(self) -> None:
        """Close this loop's connections. The client stays usable: it reconnects lazily."""
        if self._forked():
            return
        loop = asyncio.get_running_loop()
        state = self._states.pop(loop, None)
        if state is not None:
            await self._close_state(state)

    def retain(self) -> None:
        """Count one more user of this loop's connections (call from inside the loop).

        Caches and pipes sharing one client in one loop retain it, and :meth:`release`
        it when done: the connections close when the last user leaves, never under a
        user that still has requests in flight.
        """
        loop = asyncio.get_running_loop()
        self._users[loop] = self._users.get(loop, 0) + 1

    async def release(self) -> None:
        """One user fewer; close this loop's connections when none is left."""
        if self._forked():
            return
        loop = asyncio.get_running_loop()
        users = self._users.get(loop, 0) - 1
        if users > 0:
            self._users[loop] = users
            return
        self._users.pop(loop, None)
        await self.close()

    async def _bounded(self, awaitable: Awaitable[T], what: str) -> T:
        """Await with the client's timeout, translating the timeout to StoreTimeout."""
        try:
            return await asyncio.wait_for(awaitable, self.timeout)
        except asyncio.TimeoutError as exc:
            raise StoreTimeout(
                f"{self.scheme} store did not answer {what} within {self.timeout:g}s "
                f"({self.safe_url}); raise `timeout=` in connect() if the store is just slow"
            ) from exc

    # -- pickling: configuration only -------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_states", None)
        state.pop("_users", None)
        state.pop("_pid", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # -- description ------------------------------------------------------------------------
    @property
    @abstractmethod
    def safe_url(self) -> str:
        """The URL with any password masked: safe for reprs and logs."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.safe_url!r})"

    # -- operations ---------------------------------------------------------------------------
    @abstractmethod
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values for ``keys`` in the same order, ``None`` where missing."""

    @abstractmethod
    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        """Store every pair; ``ttl`` in seconds (``None``: no expiry)."""

    @abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys``; missing keys are ignored."""

    @abstractmethod
    async def ping(self) -> None:
        """Round trip to every server; raises StoreError when one does not answer."""

    def blocking_reader(self) -> Any:
        """A reader the consumer thread can drive itself (see ``blocking_resp``), or
        None when this store's reads must go through the event loop."""
        return None

    async def get(self, key: bytes) -> bytes | None:
        return (await self.get_many([key]))[0]

    async def set(self, key: bytes, value: bytes, ttl: float | None = None) -> None:
        await self.set_many({key: value}, ttl)


def chunked(seq: Sequence[T], size: int) -> list[Sequence[T]]:
    """``seq`` cut into consecutive slices of at most ``size`` items."""
    return [seq[i : i + size] for i in range(0, len(seq), size)]
