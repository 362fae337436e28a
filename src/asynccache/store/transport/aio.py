"""The one asyncio connection: requests pipelined on one transport, replies handed back in
order by a sans-IO parser from ``protocol/``.

Every exchange (one or many pipelined commands) owns a slot in a FIFO that collects
exactly as many replies as it sent commands, then resolves one future. A caller that
gives up leaves its slot in place, so a late reply is consumed by its own slot and can
never be read as the answer to the next request; after a timeout (one ``call_later``
timer per exchange, not a ``wait_for`` Task) the connection is closed anyway. A request
that finds an idle connection closed by the server before any reply is sent once more
on a fresh one: idempotent commands only.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import StoreError, StoreUnavailable
from .endpoint import Endpoint

__all__ = ["AsyncConnection", "PipelinedProtocol", "ReceivingProtocol", "Sent", "StreamProtocol",
           "close_transport"]


def close_transport(transport: asyncio.BaseTransport) -> None:
    """Close an asyncio connection now. A TLS transport is aborted: ``close()`` would first
    exchange close_notify alerts with the server, which keeps the socket open for a round
    trip (up to the loop's SSL shutdown timeout, 30 s, with a dead server) and past the
    end of a loop that stops right after; a cache connection has nothing left to flush."""
    if transport.get_extra_info("sslcontext") is not None:
        transport.abort()  # type: ignore[attr-defined]
    else:
        transport.close()


class _Waiter:
    """One exchange's slot in the FIFO: its future and the replies gathered so far."""

    __slots__ = ("future", "n", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], n: int) -> None:
        self.future = future
        self.n = n
        self.replies: list[Any] = []


class PipelinedProtocol(asyncio.BaseProtocol):
    """One connection's stream, matched to its requests. A subclass sets `parser`
    (``gets``: the next reply or False) and says what a parse error means
    (`unexpected()`); how bytes reach the parser is `StreamProtocol`'s or
    `ReceivingProtocol`'s (an event loop takes a protocol that is an
    ``asyncio.Protocol`` as one, so the two are apart)."""

    parser: Any

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.failure: StoreError | None = None
        self.replies = 0  # replies received so far on this connection
        self.retired = False  # closed once its last reply is in (`retire()`)

    def unexpected(self, exc: Exception) -> StoreError:
        """What bytes that are not a reply to the oldest request mean."""
        return StoreError(f"{self.endpoint.kind} {self.endpoint.where} sent an unexpected "
                          f"reply: {exc}")

    def expect(self, requests: Sequence[Any]) -> None:
        """``requests`` were just written (a parser that checks replies against them)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def deliver(self) -> None:
        """Hand every complete reply to its waiter, in order."""
        waiters = self.waiters
        gets = self.parser.gets
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
                raise ValueError("a reply nobody asked for")
            if self.retired and self.transport is not None:
                close_transport(self.transport)
        except StoreError as exc:  # what the protocol says a reply means for the stream
            self.fail(exc)
        except Exception as exc:  # the parser's: the stream is not what was asked for
            self.fail(self.unexpected(exc))

    def retire(self) -> None:
        """No request will be sent here any more: close once every reply is in."""
        self.retired = True
        if not self.waiters and self.transport is not None:
            close_transport(self.transport)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        ep = self.endpoint
        self.fail(StoreUnavailable(f"{ep.kind} connection to {ep.where} was closed{reason}"
                                   f"{ep.closed_hint(not self.replies)}"))

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


class StreamProtocol(PipelinedProtocol, asyncio.Protocol):
    """A `PipelinedProtocol` fed the event loop's ``bytes`` (the parser's ``feed``)."""

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        self.deliver()


class ReceivingProtocol(PipelinedProtocol, asyncio.BufferedProtocol):
    """A `PipelinedProtocol` whose parser says where the next bytes go (``buffer()``,
    then ``received(n)``): the event loop receives straight into it, so a large value
    arrives in memory of its own instead of in the loop's ``bytes`` (a copy of every
    byte), and is handed out as that buffer (`BaseClient.reads_own_buffers`)."""

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.parser.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.parser.received(nbytes)
        except Exception as exc:  # the parser's: bytes that cannot be a reply
            self.fail(self.unexpected(exc))
            return
        self.deliver()


@dataclass(slots=True)
class Sent:
    """Commands written by `AsyncConnection.send_now()`, their replies to come."""

    proto: PipelinedProtocol
    future: asyncio.Future[list[Any]]
    timer: asyncio.TimerHandle
    idle: bool  # nothing else was in flight: a close before any reply is worth a resend
    replies_before: int
    buffers: Sequence[bytes | memoryview]
    n: int
    requests: Sequence[Any]

    def cancel(self) -> None:
        """Nobody waits for these replies any more (they are consumed when they come)."""
        self.future.cancel()
        self.timer.cancel()


class AsyncConnection:
    """One pipelined connection to one server, opened lazily in the running loop.

    A subclass says which protocol speaks on it (`_protocol()`) and what a new
    connection sends first (`_setup()`)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._proto: PipelinedProtocol | None = None
        self._connecting: asyncio.Future[PipelinedProtocol] | None = None

    def _protocol(self) -> PipelinedProtocol:
        raise NotImplementedError

    async def _setup(self, proto: PipelinedProtocol) -> None:
        """Send what a new connection needs first; raise (after ``proto.fail``) if the
        server refused it."""

    async def _connected(self) -> PipelinedProtocol:
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

    async def _connect(self) -> PipelinedProtocol:
        proto = self._protocol()
        await self.endpoint.open_connection(lambda: proto)
        await self._setup(proto)
        self._proto = proto
        return proto

    def _write(self, proto: PipelinedProtocol, buffers: Sequence[bytes | memoryview],
               n: int, requests: Sequence[Any]) -> asyncio.Future[list[Any]]:
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        proto.waiters.append(_Waiter(fut, n))
        proto.expect(requests)
        proto.transport.writelines(buffers)  # type: ignore[union-attr]
        return fut

    async def _send(self, proto: PipelinedProtocol, buffers: Sequence[bytes | memoryview],
                    n: int, requests: Sequence[Any] = ()) -> list[Any]:
        """Write ``buffers`` (``n`` commands) and wait for their ``n`` replies (bounded)."""
        if proto.failure is not None:
            raise proto.failure
        fut = self._write(proto, buffers, n, requests)
        timer = asyncio.get_running_loop().call_later(self.endpoint.timeout, self._expire,
                                                      proto)
        try:
            return await fut
        finally:
            timer.cancel()

    def _expire(self, proto: PipelinedProtocol) -> None:
        proto.fail(self.endpoint.no_answer())

    async def execute_packed(self, buffers: Sequence[bytes | memoryview], n: int,
                             requests: Sequence[Any] = ()) -> list[Any]:
        """``buffers`` hold ``n`` commands, written back to back: their ``n`` replies in
        order (error replies included, as values). Idempotent commands only: one that
        found an idle connection closed by the server is sent once more."""
        if not n:
            return []
        sent = self.send_now(buffers, n, requests)
        if sent is None:
            proto = await self._connected()
            sent = self.send_now(buffers, n, requests)
            if sent is None:  # it failed again meanwhile
                raise proto.failure or StoreUnavailable(
                    f"{self.endpoint.kind} {self.endpoint.where}: the connection closed")
        return await self.result(sent)

    def send_now(self, buffers: Sequence[bytes | memoryview], n: int,
                 requests: Sequence[Any] = ()) -> Sent | None:
        """Write ``n`` packed commands now, if the connection is open (None otherwise:
        use `execute_packed()`); `result()` waits for their replies. Sending to
        several nodes first and waiting after needs no Task per node."""
        proto = self._proto
        if proto is None or proto.failure is not None or not n:
            return None
        idle, before = not proto.waiters, proto.replies
        fut = self._write(proto, buffers, n, requests)
        timer = asyncio.get_running_loop().call_later(self.endpoint.timeout, self._expire,
                                                      proto)
        return Sent(proto, fut, timer, idle, before, buffers, n, requests)

    async def result(self, sent: Sent) -> list[Any]:
        """The replies of what `send_now()` sent (bounded by the timeout)."""
        try:
            return await sent.future
        except StoreUnavailable:
            if not (sent.idle and sent.proto.replies == sent.replies_before):
                raise
            # the server had closed the idle connection: once more on a fresh one
            return await self._send(await self._connected(), sent.buffers, sent.n,
                                    sent.requests)
        finally:
            sent.timer.cancel()

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            close_transport(self._proto.transport)
        self._proto = None
