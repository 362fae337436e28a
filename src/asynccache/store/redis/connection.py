"""A lean, pipelined RESP connection for the read hot path (``MGET``), on hiredis.

Why not redis-py here: measured on this project's CI machine, one ``MGET`` through
``redis.asyncio`` 8.x costs 80–170 µs of CPU whatever its size (connection-pool
condition and timeouts, health checks, retry wrapper, per-argument packing, a
``wait_for`` Task per send and per read). Read-ahead issues thousands of them, on a loop
thread that shares the GIL with the training loop, so that overhead *is* the cost of a
cached read. This module keeps only what an ``MGET`` needs: one connection per loop,
requests written back to back (pipelined), replies parsed by ``hiredis.Reader`` and
handed to waiting futures in order. redis-py stays in charge of everything else
(cluster topology).

Ordering safety: every exchange (one or many pipelined commands) owns a slot in a FIFO
of waiters, which collects exactly as many replies as the exchange sent commands and
then resolves one future: a cluster node's 30 ``GET`` s cost one future, not 30. A
caller that gives up (timeout, cancellation) leaves its slot in place, so a late reply
is consumed by its own slot and can never be read as the answer to the next request.
After a timeout the connection is closed anyway (a store that does not answer is not
trusted to).

Idle connections: a server may close a connection that sat idle (Redis ``timeout``).
When a request sent on an idle connection finds it closed before any reply arrived,
it is sent once more on a fresh connection: a server-closed idle connection costs no
error.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import StoreError, StoreTimeout, StoreUnavailable
from ..protocol.resp import (
    check_mget_reply,
    new_parser,
    pack_mget,
    setup_refused,
    unexpected_reply,
)
from ..transport.endpoint import RedisEndpoint, close_transport, connect_failure

#: One request: the buffers of one command, written back to back (values not copied).
Request = Sequence[bytes | memoryview]

__all__ = ["RespConnection", "Sent"]


class _Waiter:
    """One exchange's slot in the FIFO: its future and the replies gathered so far."""

    __slots__ = ("future", "n", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], n: int) -> None:
        self.future = future
        self.n = n
        self.replies: list[Any] = []


@dataclass(slots=True)
class Sent:
    """Commands written by :meth:`RespConnection.send_now`, their replies to come."""

    proto: _Protocol
    future: asyncio.Future[list[Any]]
    timer: asyncio.TimerHandle
    idle: bool  # nothing else was in flight: a close before any reply is worth a resend
    replies_before: int
    buffers: Sequence[bytes | memoryview]
    n: int

    def cancel(self) -> None:
        """Nobody waits for these replies any more (they are consumed when they come)."""
        self.future.cancel()
        self.timer.cancel()


class _Protocol(asyncio.Protocol):
    def __init__(self, where: str, endpoint: RedisEndpoint | None = None) -> None:
        self.where = where
        self.endpoint = endpoint
        self.reader = new_parser()
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.failure: StoreError | None = None
        self.replies = 0  # replies received so far on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiters = self.waiters
        gets = self.reader.gets
        try:
            while waiters:
                waiter = waiters[0]
                got = waiter.replies
                before = len(got)
                for _ in range(waiter.n - before):
                    reply = gets()
                    if reply is False:
                        break
                    got.append(reply)
                self.replies += len(got) - before
                if len(got) < waiter.n:
                    return  # the rest is still on the wire
                waiters.popleft()
                fut = waiter.future
                if not fut.done():
                    fut.set_result(got)
            if gets() is not False:
                raise StoreError("a reply nobody asked for")
        except Exception as exc:  # hiredis.ProtocolError, or a reply nobody asked for
            address = self.endpoint.address if self.endpoint is not None else None
            self.fail(unexpected_reply(self.where, exc, address))

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        hint = "" if self.endpoint is None else self.endpoint.closed_hint(not self.replies)
        self.fail(StoreUnavailable(f"redis connection to {self.where} was closed{reason}"
                                   f"{hint}"))

    def fail(self, error: StoreError) -> None:
        """Fail every pending request and refuse new ones; close the transport."""
        if self.failure is None:
            self.failure = error
        while self.waiters:
            fut = self.waiters.popleft().future
            if not fut.done():
                fut.set_exception(error)
        if self.transport is not None:
            close_transport(self.transport)


class RespConnection:
    """One pipelined connection to a Redis-protocol server, opened lazily."""

    def __init__(self, endpoint: RedisEndpoint) -> None:
        self.endpoint = endpoint
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
        ep = self.endpoint
        loop = asyncio.get_running_loop()
        proto = _Protocol(ep.where, ep)
        try:
            if ep.unix_socket_path:
                coro = loop.create_unix_connection(lambda: proto, ep.unix_socket_path)
            else:
                tls = ep.ssl_context()
                coro = loop.create_connection(
                    lambda: proto, ep.host, ep.port, ssl=tls,
                    server_hostname=ep.host if tls is not None else None)
            await asyncio.wait_for(coro, ep.connect_timeout)
        except (asyncio.TimeoutError, OSError) as exc:  # ssl.SSLError is an OSError
            raise connect_failure("redis", ep.where, exc, ep.tls, ep.connect_timeout) from exc
        setup = ep.setup_requests()
        if setup:
            refused = setup_refused(ep.where, await self._send(proto, setup, len(setup)))
            if refused is not None:
                proto.fail(refused)
                raise refused
        self._proto = proto
        return proto

    async def _send(self, proto: _Protocol, buffers: Sequence[bytes | memoryview],
                    n: int) -> list[Any]:
        """Write ``buffers`` (``n`` commands) back to back and wait for their ``n``
        replies (bounded).

        One future and one timer for the whole exchange (a ``call_later`` handle, not
        ``wait_for``, which costs a Task per call on this hot path).
        """
        if proto.failure is not None:
            raise proto.failure
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        proto.waiters.append(_Waiter(fut, n))
        proto.transport.writelines(buffers)  # type: ignore[union-attr]
        timer = loop.call_later(self.endpoint.timeout, self._expire, proto)
        try:
            return await fut
        finally:
            timer.cancel()

    def _expire(self, proto: _Protocol) -> None:
        proto.fail(StoreTimeout(
            f"redis {self.endpoint.where} did not answer within {self.endpoint.timeout:g}s; "
            "raise `timeout=` in connect() if the store is just slow"))

    async def execute(self, requests: Sequence[Request]) -> list[Any]:
        """Send every request pipelined; their replies in order (error replies included,
        as ``hiredis.ReplyError`` values). Commands must be idempotent: one that found an
        idle connection closed by the server is sent once more."""
        return await self.execute_packed(list(itertools.chain.from_iterable(requests)),
                                         len(requests))

    async def execute_packed(self, buffers: Sequence[bytes | memoryview], n: int
                             ) -> list[Any]:
        """``buffers`` hold ``n`` commands, already packed back to back: their ``n``
        replies in order (as :meth:`execute`; idempotent commands only)."""
        if not n:
            return []
        sent = self.send_now(buffers, n)
        if sent is None:
            proto = await self._connected()
            sent = self.send_now(buffers, n)
            if sent is None:  # it failed again meanwhile
                raise proto.failure or StoreUnavailable(f"redis {self.endpoint.where}: "
                                                        "the connection closed")
        return await self.result(sent)

    def send_now(self, buffers: Sequence[bytes | memoryview], n: int) -> Sent | None:
        """Write ``n`` packed commands now, if the connection is open (None otherwise:
        use :meth:`execute_packed`); :meth:`result` waits for their replies. Sending to
        several nodes first and waiting after needs no Task per node."""
        proto = self._proto
        if proto is None or proto.failure is not None or not n:
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        sent = Sent(proto, fut, loop.call_later(self.endpoint.timeout, self._expire, proto),
                    not proto.waiters, proto.replies, buffers, n)
        proto.waiters.append(_Waiter(fut, n))
        proto.transport.writelines(buffers)  # type: ignore[union-attr]
        return sent

    async def result(self, sent: Sent) -> list[Any]:
        """The replies of what :meth:`send_now` sent (bounded by the timeout)."""
        try:
            return await sent.future
        except StoreUnavailable:
            if not (sent.idle and sent.proto.replies == sent.replies_before):
                raise
            # the server had closed the idle connection: once more on a fresh one
            return await self._send(await self._connected(), sent.buffers, sent.n)
        finally:
            sent.timer.cancel()

    async def mget(self, chunks: Sequence[Sequence[bytes]]) -> list[bytes | None]:
        """Values of every key of every chunk, one pipelined MGET per chunk, in order."""
        replies = await self.execute([[pack_mget(chunk)] for chunk in chunks])
        out: list[bytes | None] = []
        where = self.endpoint.where
        for reply in replies:
            out.extend(check_mget_reply(reply, where))
        return out

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            close_transport(self._proto.transport)
        self._proto = None
