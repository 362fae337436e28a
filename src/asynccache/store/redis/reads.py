"""Pipelined ``MGET`` on a plain or TLS socket, driven by the consumer thread itself.

Why this exists next to the asyncio core: with read-ahead on the loop thread, the
consumer (the training loop calling ``dp[i]``) and the loop thread take turns on the
GIL. A loop thread woken by a reply waits for the consumer to block before it can parse
it, so the two threads' costs add up and the consumer stalls once per batch; measured on
the CI machine, that path peaked at about half the throughput of a plain single-threaded
asyncio ``MGET`` loop. Here the consumer sends the read-ahead requests itself and parses
whatever replies have arrived, without blocking, each time it tops up the window; it
blocks on the socket only when the very index it needs is still on the wire.

Each consumer thread owns its connection (nothing here is shared between threads).

Deadlines, end to end: every request gets ``deadline = sent + timeout``. The socket is
non-blocking; waits go through ``poll()`` with the time left until the *oldest*
pending request's deadline, so a server that trickles bytes, or sends nothing, costs at
most one ``timeout`` — not one timeout per ``recv``. Past the deadline the connection
is closed and ``StoreTimeout`` raised; the caller counts it and falls back.

Idle connections: before sending on a connection with nothing in flight, a readable
socket (EOF: the server closed it, e.g. Redis ``timeout``) is replaced. If the first
exchange after an idle period still finds the connection closed before any reply, the
pending requests are sent once more on a fresh connection; neither costs an error.

TLS: the socket is an ``ssl.SSLSocket`` in non-blocking mode (handshake within
``connect_timeout``, :func:`~asynccache.store.transport.endpoint.open_stream`). A read or write
that needs the other direction first raises ``SSLWantReadError``/``SSLWantWriteError``
and is waited for like ``EAGAIN``; reads go on until the SSL object has nothing left
(``recv`` returns one TLS record at a time), and every wait for readability asks the SSL
object for buffered bytes before it polls the socket.
"""

from __future__ import annotations

import collections
import select
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

from ...errors import StoreError, StoreTimeout, StoreUnavailable
from ..api import ConsumerConnection
from ..protocol.resp import (
    check_mget_reply,
    new_parser,
    pack_mget,
    setup_refused,
    unexpected_reply,
)
from ..protocol.resp_bulk import BIG_VALUE, BulkReader
from ..transport.endpoint import RedisEndpoint, readable_while_idle, wait_ready

__all__ = ["BlockingRespConnection"]

_RECV_SIZE = 1 << 18
#: the largest value a reply may claim (Redis' own proto-max-bulk-len default)
_MAX_VALUE = 512 << 20
#: weight of the newest reply in the value-size estimate that picks the parser
_ALPHA = 0.5
_POLLIN = select.POLLIN | select.POLLERR | select.POLLHUP
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP


def _value_buffer(size: int) -> bytearray | memoryview:
    """Memory for one large value, not zeroed first (the socket overwrites all of it):
    ``numpy.empty`` when numpy is installed (``bytearray(n)`` writes n zeros, a pass
    over memory as long as the copy from the kernel), else a bytearray."""
    np = _numpy()
    if np is None:
        return bytearray(size)
    return memoryview(np.empty(size, dtype=np.uint8))


def _numpy() -> Any:
    global _NP
    if _NP is False:
        try:
            import numpy
        except ImportError:
            _NP = None
        else:
            _NP = numpy
    return _NP


_NP: Any = False


class _Closed(Exception):
    """The peer closed the connection (or reset it) before a reply was complete."""


class BlockingRespConnection(ConsumerConnection):
    """One socket, many MGETs in flight, replies matched to requests in order."""

    def __init__(self, endpoint: RedisEndpoint, node: str | None = None) -> None:
        self.endpoint = endpoint
        self.node = node if node is not None else endpoint.where
        self.sock: socket.socket | None = None
        #: large values (an estimate of the replies' first values >= BIG_VALUE) are read
        #: by a BulkReader, each into its own buffer; small ones by hiredis
        self.big = False
        self.value_bytes = 0.0
        self.parser: Any = new_parser()
        #: requests sent and not answered yet: (deadline, packed request), oldest first
        self.pending: collections.deque[tuple[float, bytes]] = collections.deque()
        #: replies received when the parser was switched, not handed out yet (oldest first)
        self.stash: collections.deque[list[Any]] = collections.deque()
        #: the pending requests were sent on a connection that had been idle and no reply
        #: came yet: a close now is the server's idle timeout, worth one silent retry
        self._may_retry = False
        #: this connection brought a reply (a close before that may be a TLS-only port)
        self._answered = False

    # -- connection ---------------------------------------------------------------------
    def _connect(self) -> None:
        ep = self.endpoint
        self.sock, self.parser = ep.open_socket(), new_parser()
        self._answered = False
        deadline = time.monotonic() + ep.timeout
        try:
            for request in ep.setup_requests():
                self._write(request, deadline)
                refused = setup_refused(ep.where, [self._read_reply(deadline)])
                self._answered = True
                if refused is not None:
                    raise refused
        except BaseException:
            self._close_socket()
            raise
        if self.big:  # setup replies are hiredis' (they are not MGET replies)
            self.parser = self._new_parser()

    def _new_parser(self) -> Any:
        return (BulkReader(max_value=_MAX_VALUE, alloc=_value_buffer) if self.big
                else new_parser())

    def _switch_parser(self) -> None:
        """Change parsers at a reply boundary: receive what is pending first (into
        ``stash``, handed out in order by poll/receive), so that no reply is split
        between the two. Happens when the value sizes cross the threshold: about once
        per connection."""
        while self.pending:
            self.stash.append(self._next_reply())
        leftover = (self.parser.has_data() if not self.big else not self.parser.idle)
        self.big = not self.big
        if leftover:  # bytes nobody asked for: the stream cannot be trusted
            self._fail()
            raise StoreError(f"redis {self.endpoint.where} sent bytes no request asked for")
        self.parser = self._new_parser()

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

    # -- requests ---------------------------------------------------------------------
    def send_get(self, keys: Sequence[bytes]) -> None:
        """Queue one MGET; its reply comes back, in order, from :meth:`poll`/:meth:`receive`."""
        packed = pack_mget(keys)
        if self.big != (self.value_bytes >= (BIG_VALUE // 4 if self.big else BIG_VALUE)):
            self._switch_parser()
        if self.sock is not None and not self.pending and readable_while_idle(self.sock):
            self._close_socket()  # the server closed it while idle: replace it quietly
        if self.sock is None:
            self._connect()
        if not self.pending:
            self._may_retry = True
        deadline = time.monotonic() + self.endpoint.timeout
        self.pending.append((deadline, packed))
        try:
            self._write(packed, deadline)
        except BaseException:
            self._fail()
            raise

    def _write(self, data: bytes, deadline: float) -> None:
        sock = self.sock
        assert sock is not None
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait(_POLLOUT, deadline, "take a request")
                continue
            except ssl.SSLWantReadError:  # TLS renegotiation: it must read first
                self._wait(_POLLIN, deadline, "take a request")
                continue
            except OSError as exc:
                raise StoreUnavailable(
                    f"redis connection to {self.endpoint.where} failed: {exc}"
                    f"{self.endpoint.closed_hint(not self._answered)}") from exc
            view = view[sent:]

    def _wait(self, events: int, deadline: float, what: str) -> None:
        """Block until the socket is ready for ``events`` or ``deadline`` passes."""
        sock = self.sock
        assert sock is not None
        remaining = deadline - time.monotonic()
        if remaining > 0 and wait_ready(sock, events, remaining):
            return
        raise StoreTimeout(
            f"redis {self.endpoint.where} did not {what} within {self.endpoint.timeout:g}s; "
            "raise `timeout=` in connect() if the store is just slow")

    # -- replies ------------------------------------------------------------------------
    def poll(self, limit: int | None = None) -> list[list[Any]]:
        """Every MGET reply that has fully arrived (at most ``limit``), without blocking.

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
        except _Closed as exc:
            self._retry_or_fail(exc)
            return out + self.poll(None if limit is None else limit - len(out))
        except BaseException:
            self._fail()
            raise
        if not out and self.pending and self.pending[0][0] <= time.monotonic():
            self._fail()
            raise self._timeout()
        return out

    def extend_deadlines(self, at_least: float) -> None:
        """Give every pending request until ``at_least`` (the consumer was away: see
        :meth:`asynccache.readahead.readers.SocketSource.resume`)."""
        pending = self.pending
        if pending and pending[0][0] < at_least:
            self.pending = collections.deque((max(d, at_least), p) for d, p in pending)

    def receive(self) -> list[Any]:
        """The next MGET reply, waiting at most until the oldest request's deadline."""
        if self.stash:
            return self.stash.popleft()
        return self._next_reply()

    def _next_reply(self) -> list[Any]:
        if not self.pending:
            raise StoreError("receive() with no request pending (asynccache bug)")
        try:
            events = _POLLIN
            while True:
                reply = self._parse()
                if reply is not False:
                    return self._accept(reply)
                if events:  # the kernel had nothing more: wait for it
                    try:
                        self._wait(events, self.pending[0][0], "answer")
                    except StoreTimeout:
                        raise self._timeout() from None
                events = self._recv_available()
        except _Closed as exc:
            self._retry_or_fail(exc)
            return self._next_reply()
        except BaseException:
            self._fail()
            raise

    def _read_reply(self, deadline: float) -> Any:
        """One reply of a setup command (before any MGET is pending)."""
        events = _POLLIN
        while (reply := self._parse()) is False:
            if events:
                self._wait(events, deadline, "answer")
            try:
                events = self._recv_available()
            except _Closed as exc:
                raise StoreUnavailable(f"redis {self.endpoint.where} closed the connection "
                                       f"during setup"
                                       f"{self.endpoint.closed_hint(not self._answered)}"
                                       ) from exc
        return reply

    def _recv_available(self) -> int:
        """Feed the parser what the kernel (and the SSL object) holds for us, about
        ``_RECV_SIZE`` bytes at most, never blocking: 0 when more may be waiting (parse,
        then call again), else the poll events to wait for before more can arrive.

        Why a budget: hiredis moves the unparsed rest of its buffer down after every
        reply it returns, so a buffer holding many large replies (a window of read-ahead
        that arrived while the consumer was busy) costs a copy of everything behind each
        reply -- tens of milliseconds for 32 MiB of 1 MiB values. Parsing between feeds
        keeps that rest to one partial reply.
        """
        sock, parser = self.sock, self.parser
        if sock is None:
            raise _Closed("connection is closed")
        tls = isinstance(sock, ssl.SSLSocket)
        if type(parser) is BulkReader:
            return self._recv_into(sock, parser, tls)
        fed = 0
        while True:
            try:
                data = sock.recv(_RECV_SIZE)
            except (BlockingIOError, ssl.SSLWantReadError):
                return _POLLIN
            except ssl.SSLWantWriteError:  # TLS must send (a key update) before it reads
                return _POLLOUT
            except OSError as exc:  # ECONNRESET, a TLS alert, and friends
                raise _Closed(str(exc)) from exc
            if not data:
                raise _Closed("closed by the server")
            parser.feed(data)
            if len(data) < _RECV_SIZE and not tls:  # TLS: one record per recv, go on
                return _POLLIN
            fed += len(data)
            if fed >= _RECV_SIZE:
                return 0

    def _recv_into(self, sock: socket.socket, reader: BulkReader, tls: bool) -> int:
        """:meth:`_recv_available` for the BulkReader: the kernel copies straight into
        the reader's buffer, or into a large value's own."""
        fed = 0
        while True:
            view = reader.buffer()
            try:
                n = sock.recv_into(view)
            except (BlockingIOError, ssl.SSLWantReadError):
                return _POLLIN
            except ssl.SSLWantWriteError:
                return _POLLOUT
            except OSError as exc:
                raise _Closed(str(exc)) from exc
            if not n:
                raise _Closed("closed by the server")
            reader.received(n)
            if n < len(view) and not tls:
                return _POLLIN
            fed += n
            if fed >= _RECV_SIZE:
                return 0

    def _parse(self) -> Any:
        try:
            return self.parser.gets()
        except Exception as exc:  # hiredis.ProtocolError
            raise unexpected_reply(self.endpoint.where, exc, self.endpoint.address) from exc

    def _accept(self, reply: Any) -> list[Any]:
        self.pending.popleft()
        self._may_retry = False
        self._answered = True
        values = check_mget_reply(reply, self.endpoint.where)
        if values and (first := values[0]) is not None:  # one look per reply: cheap
            self.value_bytes += _ALPHA * (len(first) - self.value_bytes)
        return values

    def _retry_or_fail(self, exc: _Closed) -> None:
        """Resend what is pending on a fresh connection, once, when the close looks like
        the server's idle timeout; otherwise fail with StoreUnavailable."""
        if not self._may_retry:
            self._fail()
            raise StoreUnavailable(
                f"redis connection to {self.endpoint.where} failed: {exc}"
                f"{self.endpoint.closed_hint(not self._answered)}") from exc
        self._may_retry = False
        requests = list(self.pending)
        self._close_socket()
        try:
            self._connect()
            for deadline, packed in requests:
                self._write(packed, deadline)
        except BaseException:
            self._fail()
            raise

    def _fail(self) -> None:
        """Forget what was in flight and close: a broken stream is never reused."""
        self.pending.clear()
        self.stash.clear()
        self._may_retry = False
        self._close_socket()

    def _timeout(self) -> StoreTimeout:
        self._fail()
        return StoreTimeout(
            f"redis {self.endpoint.where} did not answer within {self.endpoint.timeout:g}s; "
            "raise `timeout=` in connect() if the store is just slow")
