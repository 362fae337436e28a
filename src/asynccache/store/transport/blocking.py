"""The one pipelined blocking connection: a consumer thread's own socket to one node.

Requests are written back to back and answered in order; subclasses say what a request
is and how a reply is parsed (Redis, memcached, a cluster node: each with its sans-IO
parser from ``protocol/``). The socket is non-blocking: every wait goes through
``poll()`` with the time left until the *oldest* pending request's deadline, so a server
that trickles bytes or sends nothing costs at most one ``timeout``. A TLS read or write
that needs the other direction first is waited for like ``EAGAIN``. A connection that
fails drops everything queued on it; one the server closed while idle is replaced, and
what was sent on it once more, without an error. See docs/design.md for why read-ahead
runs on the consumer's thread.
"""

from __future__ import annotations

import collections
import select
import socket
import ssl
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import StoreError, StoreTimeout
from ..api import ConsumerConnection, NodeName
from .endpoint import Endpoint, readable_while_idle, wait_ready

__all__ = ["RECV_BUDGET", "BlockingConnection", "Request"]

#: Bytes received per call before the replies are parsed: a parser keeps its unparsed
#: rest to about one reply, so a window of large replies is not copied once per reply.
RECV_BUDGET = 1 << 18
POLLIN = select.POLLIN | select.POLLERR | select.POLLHUP
POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP


class Closed(Exception):
    """The peer closed the connection (or reset it) before a reply was complete."""


class Request:
    """One request on the wire: its bytes, how many keys it asks for (what its reply must
    hold) and its deadline (``time.monotonic()``)."""

    __slots__ = ("count", "deadline", "packed")

    def __init__(self, packed: bytes, count: int = 0) -> None:
        self.packed = packed
        self.count = count
        self.deadline = 0.0


class BlockingConnection(ConsumerConnection):
    """One socket, many requests in flight, replies matched to requests in order.

    A subclass implements `_request()` (keys -> a `Request`), `_new_parser()`
    (a sans-IO parser with ``buffer()``/``received(n)``) and `_parse()` (the oldest
    request's reply, or False while it is incomplete: a reply is never False).
    """

    def __init__(self, endpoint: Endpoint, node: NodeName | None = None) -> None:
        self.endpoint = endpoint
        self.node = node if node is not None else NodeName(endpoint.where)
        self.sock: socket.socket | None = None
        self.parser: Any = None
        #: requests sent and not answered yet, oldest first
        self.pending: collections.deque[Any] = collections.deque()
        #: replies parsed and not handed out yet (oldest first)
        self.stash: collections.deque[list[Any]] = collections.deque()
        #: the pending requests were sent on a connection that had been idle and no reply
        #: came yet: a close now is the server's idle timeout, worth one silent retry
        self._may_retry = False
        #: this connection brought a reply (a close before that may be a TLS-only port)
        self._answered = False

    # -- what a protocol says ---------------------------------------------------------------
    @abstractmethod
    def _request(self, keys: Sequence[bytes]) -> Request:
        """The request that asks for ``keys`` (its deadline is set when it is sent)."""

    @abstractmethod
    def _new_parser(self) -> Any:
        """A fresh sans-IO parser for a new connection."""

    @abstractmethod
    def _parse(self) -> Any:
        """The oldest pending request's reply if it is complete, else False. Raises a
        StoreError when the bytes cannot be its reply (the connection is then dropped)."""

    def _accept(self, reply: Any) -> list[Any]:
        """The oldest request was answered with ``reply``: its values."""
        self.pending.popleft()
        self._may_retry = False
        self._answered = True
        return reply

    def _sent(self, request: Request) -> None:
        """``request`` is about to be written (again, after a reconnect)."""

    def _setup(self, deadline: float) -> None:
        """What a new connection does before its first request (Redis: AUTH, SELECT)."""

    def _idle_closed(self) -> bool:
        """An idle connection the server closed (or that holds bytes nobody asked for)."""
        assert self.sock is not None
        return readable_while_idle(self.sock)

    # -- connection ---------------------------------------------------------------------------
    def _connect(self) -> None:
        self.sock, self.parser = self.endpoint.open_socket(), self._new_parser()
        self._answered = False
        try:
            self._setup(time.monotonic() + self.endpoint.timeout)
        except BaseException:
            self._close_socket()
            raise

    def close(self) -> None:
        """Close the connection and forget every request and reply queued on it: a reply
        of this stream can never be matched to a request sent after (the next request
        opens a fresh connection)."""
        self._fail()

    def _close_socket(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None

    def __del__(self) -> None:
        # A consumer thread's connection dies with its owner (a pipe or node that was
        # dropped without close(), a thread that ended): close the socket, quietly.
        self._close_socket()

    def _fail(self) -> None:
        """Forget what was in flight and close: a broken stream is never reused."""
        self.pending.clear()
        self.stash.clear()
        self._may_retry = False
        self._close_socket()

    def _timeout(self) -> StoreTimeout:
        self._fail()
        return self.endpoint.no_answer()

    # -- requests -----------------------------------------------------------------------------
    def send_get(self, keys: Sequence[bytes]) -> None:
        """Queue one multi-get; its reply comes back, in order, from `poll()` /
        `receive()`."""
        request = self._request(keys)
        if self.sock is not None and not self.pending and self._idle_closed():
            self._close_socket()  # the server closed it while idle: replace it quietly
        if self.sock is None:
            self._connect()
        if not self.pending:
            self._may_retry = True
        request.deadline = time.monotonic() + self.endpoint.timeout
        self.pending.append(request)
        try:
            self._send(request)
        except BaseException:
            self._fail()
            raise

    def _send(self, request: Request) -> None:
        self._sent(request)
        self._write(request.packed, request.deadline)

    def _write(self, data: bytes, deadline: float) -> None:
        sock = self.sock
        assert sock is not None
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait(POLLOUT, deadline, "take a request")
                continue
            except ssl.SSLWantReadError:  # TLS renegotiation: it must read first
                self._wait(POLLIN, deadline, "take a request")
                continue
            except OSError as exc:
                raise self.endpoint.broken(exc, not self._answered) from exc
            view = view[sent:]

    def _wait(self, events: int, deadline: float, what: str) -> None:
        """Block until the socket is ready for ``events`` or ``deadline`` passes."""
        sock = self.sock
        assert sock is not None
        remaining = deadline - time.monotonic()
        if remaining > 0 and wait_ready(sock, events, remaining):
            return
        raise self.endpoint.no_answer(what)

    def extend_deadlines(self, at_least: float) -> None:
        """Give every pending request until ``at_least`` (the consumer was away)."""
        for request in self.pending:
            if request.deadline < at_least:
                request.deadline = at_least

    # -- replies ------------------------------------------------------------------------------
    def poll(self, limit: int | None = None) -> list[list[Any]]:
        """Every reply that has fully arrived (at most ``limit``), without blocking.

        With a limit, bytes are read only until that many replies are complete: the
        consumer waiting for the oldest request does not pay for receiving (and the
        caller for decoding) a whole window of read-ahead at once.
        """
        out: list[list[Any]] = []
        stash = self.stash
        while stash and (limit is None or len(out) < limit):
            out.append(stash.popleft())
        if not self.pending:
            return out
        want = len(out) + (len(self.pending) if limit is None
                           else min(limit - len(out), len(self.pending)))
        try:
            while len(out) < want:
                reply = self._parse()
                if reply is not False:
                    out.append(self._accept(reply))
                elif self._recv_available() != 0:  # the kernel is drained: parse, stop
                    while len(out) < want and (reply := self._parse()) is not False:
                        out.append(self._accept(reply))
                    break
        except Closed as exc:
            self._retry_or_fail(exc)
            return out + self.poll(None if limit is None else limit - len(out))
        except BaseException:
            self._fail()
            raise
        if not out and self.pending and self.pending[0].deadline <= time.monotonic():
            raise self._timeout()
        return out

    def receive(self) -> list[Any]:
        """The next reply, waiting at most until the oldest request's deadline."""
        if self.stash:
            return self.stash.popleft()
        return self._next_reply()

    def _next_reply(self) -> list[Any]:
        if not self.pending:
            raise StoreError("receive() with no request pending (asynccache bug)")
        try:
            return self._accept(self._read_one(self.pending[0].deadline, "answer"))
        except StoreTimeout:
            raise self._timeout() from None
        except Closed as exc:
            self._retry_or_fail(exc)
            return self._next_reply()
        except BaseException:
            self._fail()
            raise

    def _read_one(self, deadline: float, what: str,
                  parse: Callable[[], Any] | None = None) -> Any:
        """The next reply ``parse`` (default: `_parse()`) makes of the bytes, waiting
        for them until ``deadline``."""
        parse = parse or self._parse
        events = POLLIN
        while (reply := parse()) is False:
            if events:  # the kernel had nothing more: wait for it
                self._wait(events, deadline, what)
            events = self._recv_available()
        return reply

    def _recv_available(self) -> int:
        """Feed the parser what the kernel (and the SSL object) holds for us, about
        ``RECV_BUDGET`` bytes at most, never blocking: 0 when more may be waiting (parse,
        then call again), else the poll events to wait for before more can arrive. An end
        of stream after some bytes is left for the next call: the replies that did
        arrive are parsed first. A TLS ``recv`` returns one record: read on until the SSL
        object has nothing left."""
        sock, parser = self.sock, self.parser
        if sock is None:
            raise Closed("connection is closed")
        tls = self.endpoint.tls is not None
        fed = 0
        while True:
            view = parser.buffer()
            try:
                n = sock.recv_into(view)
            except (BlockingIOError, ssl.SSLWantReadError):
                return POLLIN
            except ssl.SSLWantWriteError:  # TLS must send (a key update) before it reads
                return POLLOUT
            except OSError as exc:  # ECONNRESET, a TLS alert, and friends
                raise Closed(str(exc)) from exc
            if not n:
                if fed:
                    return POLLIN
                raise Closed("closed by the server")
            parser.received(n)
            if n < len(view) and not tls:
                return POLLIN
            fed += n
            if fed >= RECV_BUDGET:
                return 0

    def _retry_or_fail(self, exc: Closed) -> None:
        """Send what is pending once more on a fresh connection when the close looks like
        the server's idle timeout; otherwise fail with StoreUnavailable."""
        if not self._may_retry:
            self._fail()
            raise self.endpoint.broken(exc, not self._answered) from exc
        self._may_retry = False
        self._close_socket()
        try:
            self._connect()
            for request in self.pending:
                self._send(request)
        except BaseException:
            self._fail()
            raise
