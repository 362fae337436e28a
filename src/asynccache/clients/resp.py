"""A lean, pipelined RESP connection for the read hot path (``MGET``), on hiredis.

Why not redis-py here: measured on this project's CI machine, one ``MGET`` through
``redis.asyncio`` 8.x costs 80–170 µs of CPU whatever its size (connection-pool
condition and timeouts, health checks, retry wrapper, per-argument packing, a
``wait_for`` Task per send and per read). Read-ahead issues thousands of them, on a loop
thread that shares the GIL with the training loop, so that overhead *is* the cost of a
cached read. This module keeps only what an ``MGET`` needs: one connection per loop,
requests written back to back (pipelined), replies parsed by ``hiredis.Reader`` and
handed to waiting futures in order. redis-py stays in charge of everything else
(writes, deletes, TLS, cluster).

Ordering safety: every request owns a slot in a FIFO of futures. A caller that gives
up (timeout, cancellation) leaves its slot in place, so a late reply is consumed by
its own slot and can never be read as the answer to the next request. After a timeout
the connection is closed anyway (a store that does not answer is not trusted to).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

import hiredis

from ..errors import StoreError, StoreTimeout, StoreUnavailable

__all__ = ["RespConnection", "pack_command", "pack_mget", "setup_commands", "setup_refused"]


def pack_command(*args: bytes) -> bytes:
    """RESP encoding of one command whose arguments are already bytes."""
    parts = [b"*%d\r\n" % len(args)]
    parts.extend(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    return b"".join(parts)


def setup_commands(username: str | None, password: str | None, db: int) -> list[bytes]:
    """``AUTH`` and ``SELECT`` a new connection needs, packed (empty when none)."""
    setup = []
    if password is not None:
        user = (username.encode(),) if username else ()
        setup.append(pack_command(b"AUTH", *user, password.encode()))
    if db:
        setup.append(pack_command(b"SELECT", str(db).encode()))
    return setup


def setup_refused(where: str, replies: Sequence[Any]) -> StoreUnavailable | None:
    """The error to raise when the server refused a setup command, else None."""
    for reply in replies:
        if isinstance(reply, hiredis.ReplyError):
            return StoreUnavailable(f"redis {where} refused the credentials or database: "
                                    f"{reply}; check user/password/db in the URL")
    return None


def pack_mget(keys: Sequence[bytes]) -> bytes:
    parts = [b"*%d\r\n$4\r\nMGET\r\n" % (len(keys) + 1)]
    parts.extend(b"$%d\r\n%s\r\n" % (len(k), k) for k in keys)
    return b"".join(parts)


class _Protocol(asyncio.Protocol):
    def __init__(self, where: str) -> None:
        self.where = where
        self.reader = hiredis.Reader()
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.failure: StoreError | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiters = self.waiters
        try:
            while (reply := self.reader.gets()) is not False:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self.fail(StoreError(f"redis {self.where} sent an unexpected reply: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self.fail(StoreUnavailable(f"redis connection to {self.where} was closed{reason}"))

    def fail(self, error: StoreError) -> None:
        """Fail every pending request and refuse new ones; close the transport."""
        if self.failure is None:
            self.failure = error
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class RespConnection:
    """One pipelined connection to a Redis-protocol server, opened lazily."""

    def __init__(self, *, host: str | None, port: int | None, unix_socket_path: str | None,
                 username: str | None, password: str | None, db: int,
                 timeout: float, connect_timeout: float, where: str) -> None:
        self.host, self.port, self.unix_socket_path = host, port, unix_socket_path
        self.username, self.password, self.db = username, password, db
        self.timeout, self.connect_timeout, self.where = timeout, connect_timeout, where
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    async def _connected(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.failure is None:
            return proto
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        proto = _Protocol(self.where)
        try:
            if self.unix_socket_path:
                coro = loop.create_unix_connection(lambda: proto, self.unix_socket_path)
            else:
                coro = loop.create_connection(lambda: proto, self.host, self.port)
            await asyncio.wait_for(coro, self.connect_timeout)
        except asyncio.TimeoutError as exc:
            raise StoreTimeout(f"connecting to redis {self.where} took over "
                               f"{self.connect_timeout:g}s") from exc
        except OSError as exc:
            raise StoreUnavailable(f"cannot connect to redis {self.where}: {exc}") from exc
        setup = setup_commands(self.username, self.password, self.db)
        if setup:
            refused = setup_refused(self.where, await self._send(proto, setup))
            if refused is not None:
                proto.fail(refused)
                raise refused
        self._proto = proto
        return proto

    async def _send(self, proto: _Protocol, packed: list[bytes]) -> list[Any]:
        """Write requests back to back and wait for their replies (bounded).

        One timer for the whole exchange (a ``call_later`` handle, not ``wait_for``,
        which costs a Task per call on this hot path).
        """
        if proto.failure is not None:
            raise proto.failure
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in packed]
        proto.waiters.extend(futures)
        proto.transport.writelines(packed)  # type: ignore[union-attr]
        timer = loop.call_later(self.timeout, self._expire, proto)
        try:
            return [await fut for fut in futures]
        except BaseException:
            for fut in futures:  # consume the siblings' errors: nobody else awaits them
                if fut.done() and not fut.cancelled():
                    fut.exception()
                else:
                    fut.cancel()
            raise
        finally:
            timer.cancel()

    def _expire(self, proto: _Protocol) -> None:
        proto.fail(StoreTimeout(
            f"redis {self.where} did not answer within {self.timeout:g}s; "
            "raise `timeout=` in connect() if the store is just slow"))

    async def mget(self, chunks: Sequence[Sequence[bytes]]) -> list[bytes | None]:
        """Values of every key of every chunk, one pipelined MGET per chunk, in order."""
        proto = await self._connected()
        replies = await self._send(proto, [pack_mget(chunk) for chunk in chunks])
        out: list[bytes | None] = []
        for reply in replies:
            if isinstance(reply, hiredis.ReplyError):
                raise StoreError(f"redis {self.where} answered MGET with an error: {reply}")
            out.extend(reply)
        return out

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
