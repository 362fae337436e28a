"""Pipelined memcached multi-gets on a plain or TLS socket, driven by the consumer thread itself.

The memcached counterpart of :mod:`asynccache.store.redis.reads` (read it for why
read-ahead runs on the consumer's own socket rather than through the loop thread), with
the same rules (TLS included: non-blocking ``SSLSocket``, ``SSLWantReadError`` /
``SSLWantWriteError`` waited for like ``EAGAIN``, buffered bytes looked for before polling):

* **Deadlines, end to end**: every request gets ``deadline = sent + timeout``; the socket
  is non-blocking and waits go through ``poll()`` with the time left until the *oldest*
  pending request's deadline, so a server that trickles bytes or sends nothing costs at
  most one ``timeout``. Past it the connection is closed and ``StoreTimeout`` raised.
* **Idle connections**: before sending on a connection with nothing in flight, one that
  became readable (EOF: memcached's ``idle_timeout`` closed it) or holds bytes nobody
  asked for is replaced. If the first exchange after an idle period still finds the
  connection closed before any reply, what is pending is sent once more on a fresh
  connection; neither costs an error.

What memcached adds: one :meth:`~BlockingMemcachedConnection.send_get` takes the store's
keys as they are, maps them with :func:`~asynccache.store.protocol.memcache.safe_memcached_key`,
asks each distinct key once (memcached answers a repeated key once per mention, so
duplicates are folded and handed back to every position), and cuts the request into
``get`` lines of at most ``max_batch`` keys; its reply is assembled from those lines.

Each consumer thread owns its connections (nothing here is shared between threads).
"""

from __future__ import annotations

import collections
import itertools
import select
import socket
import ssl
import time
from collections.abc import Sequence

from ...errors import StoreError, StoreTimeout, StoreUnavailable
from ..api import ConsumerConnection, chunked
from ..protocol.memcache import (
    ProtocolViolation,
    ReplyParser,
    no_answer,
    pack_get,
    safe_memcached_keys,
    unexpected_reply,
)
from ..transport.endpoint import (
    TlsSettings,
    closed_hint,
    open_stream,
    readable_while_idle,
    wait_ready,
)

__all__ = ["BlockingMemcachedConnection"]

#: bytes asked of the kernel per read, into one buffer per connection that is reused:
#: ``recv(n)`` would allocate (and give back) ``n`` bytes per call, 256 KiB included when a
#: reply is a few KiB, or none at all has arrived yet
_RECV_SIZE = 1 << 18
_POLLIN = select.POLLIN | select.POLLERR | select.POLLHUP
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP


class _Closed(Exception):
    """The peer closed the connection (or reset it) before a reply was complete."""


class _Get:
    """One ``send_get``: its ``get`` lines, the replies parsed so far, and its deadline."""

    __slots__ = ("asked", "deadline", "packed", "replies", "requests", "unique")

    def __init__(self, keys: Sequence[bytes], max_batch: int, deadline: float) -> None:
        safe = safe_memcached_keys(keys)
        self.unique = list(dict.fromkeys(safe))
        #: the memcached key of every position, kept only when some key repeats
        self.asked = safe if len(self.unique) != len(safe) else None
        self.requests = [pack_get(chunk) for chunk in chunked(self.unique, max_batch)]
        self.packed = b"".join(itertools.chain.from_iterable(r.buffers for r in self.requests))
        self.replies: list[list[bytes | None]] = []
        self.deadline = deadline

    @property
    def complete(self) -> bool:
        return len(self.replies) == len(self.requests)

    def values(self) -> list[bytes | None]:
        """One value per key asked, in the order asked."""
        if len(self.replies) == 1:
            flat = self.replies[0]
        else:
            flat = list(itertools.chain.from_iterable(self.replies))
        if self.asked is None:
            return flat
        found = dict(zip(self.unique, flat))
        return [found[key] for key in self.asked]


class BlockingMemcachedConnection(ConsumerConnection):
    """One socket to one memcached server, many multi-gets in flight, replies in order."""

    def __init__(self, host: str, port: int, *, timeout: float, connect_timeout: float,
                 max_value: int, max_batch: int = 128, tls: TlsSettings | None = None) -> None:
        self.host = host
        self.port = port
        self.node = f"{host}:{port}"
        self.tls = tls
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_value = max_value
        self.max_batch = max_batch
        self.sock: socket.socket | None = None
        self.parser = ReplyParser(max_value)
        self._inbox = memoryview(bytearray(_RECV_SIZE))
        #: requests sent and not answered yet, oldest first
        self.pending: collections.deque[_Get] = collections.deque()
        #: the pending requests were sent on a connection that had been idle and no reply
        #: came yet: a close now is the server's idle timeout, worth one silent retry
        self._may_retry = False
        #: this connection brought a reply (a close before that may be a TLS-only port)
        self._answered = False

    # -- connection ---------------------------------------------------------------------
    def _connect(self) -> None:
        sock = open_stream(self.host, self.port, tls=self.tls,
                           connect_timeout=self.connect_timeout, kind="memcached",
                           where=self.node)
        self.sock, self.parser = sock, ReplyParser(self.max_value)
        self._answered = False

    def _closed_hint(self) -> str:
        return closed_hint(self.tls, fresh=not self._answered,
                           tls_url=f"memcached://{self.node}?tls=true")

    def _idle_and_closed(self) -> bool:
        """True when an idle connection became readable (EOF, or bytes nobody asked for)."""
        assert self.sock is not None
        return bool(self.parser.buffered) or readable_while_idle(self.sock)

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
        """Queue one multi-get; its values come back, in order, from :meth:`poll` /
        :meth:`receive`, one per key of ``keys`` (``None`` where absent)."""
        get = _Get(keys, self.max_batch, 0.0)
        if self.sock is not None and not self.pending and self._idle_and_closed():
            self._close_socket()  # the server closed it while idle: replace it quietly
        if self.sock is None:
            self._connect()
        if not self.pending:
            self._may_retry = True
        get.deadline = time.monotonic() + self.timeout
        self.pending.append(get)
        try:
            self._send(get)
        except BaseException:
            self._fail()
            raise

    def _send(self, get: _Get) -> None:
        for request in get.requests:
            self.parser.expect(request)
        self._write(get.packed, get.deadline)

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
                    f"memcached connection to {self.node} failed: {exc}"
                    f"{self._closed_hint()}") from exc
            view = view[sent:]

    def _wait(self, events: int, deadline: float, what: str) -> None:
        """Block until the socket is ready for ``events`` or ``deadline`` passes."""
        sock = self.sock
        assert sock is not None
        remaining = deadline - time.monotonic()
        if remaining > 0 and wait_ready(sock, events, remaining):
            return
        raise StoreTimeout(
            f"memcached {self.node} did not {what} within {self.timeout:g}s; "
            "raise `timeout=` in connect() if the store is just slow")

    # -- replies ------------------------------------------------------------------------
    def poll(self, limit: int | None = None) -> list[list[bytes | None]]:
        """Every multi-get reply that has fully arrived (at most ``limit``), without
        blocking."""
        if not self.pending:
            return []
        want = len(self.pending) if limit is None else min(limit, len(self.pending))
        out: list[list[bytes | None]] = []
        try:
            while len(out) < want:
                values = self._parse()
                if values is not None:
                    out.append(self._accept(values))
                elif self._recv_available() != 0:  # the kernel is drained: parse, stop
                    while len(out) < want and (values := self._parse()) is not None:
                        out.append(self._accept(values))
                    break
        except _Closed as exc:
            self._retry_or_fail(exc)
            return out + self.poll(None if limit is None else limit - len(out))
        except BaseException:
            self._fail()
            raise
        if not out and self.pending and self.pending[0].deadline <= time.monotonic():
            raise self._timeout()
        return out

    def extend_deadlines(self, at_least: float) -> None:
        """Give every pending request until ``at_least`` (the consumer was away: see
        :meth:`asynccache.readahead.readers.SocketSource.resume`)."""
        for get in self.pending:
            get.deadline = max(get.deadline, at_least)

    def receive(self) -> list[bytes | None]:
        """The next multi-get reply, waiting at most until the oldest request's deadline."""
        if not self.pending:
            raise StoreError("receive() with no request pending (asynccache bug)")
        try:
            events = _POLLIN
            while True:
                values = self._parse()
                if values is not None:
                    return self._accept(values)
                if events:  # the kernel had nothing more: wait for it
                    try:
                        self._wait(events, self.pending[0].deadline, "answer")
                    except StoreTimeout:
                        raise self._timeout() from None
                events = self._recv_available()
        except _Closed as exc:
            self._retry_or_fail(exc)
            return self.receive()
        except BaseException:
            self._fail()
            raise

    def _recv_available(self) -> int:
        """Feed the parser what the kernel (and the SSL object) holds for us, about
        ``_RECV_SIZE`` bytes at most, never blocking: 0 when more may be waiting (parse,
        then call again), else the poll events to wait for before more can arrive. The
        budget keeps the parser's unparsed rest to about one reply: it joins that rest
        with what arrives, so a buffer of many large replies parsed one at a time would
        be copied once per reply.

        An end of stream after some bytes is left for the next call: the replies that
        did arrive are parsed first.
        """
        sock, parser, inbox = self.sock, self.parser, self._inbox
        if sock is None:
            raise _Closed("connection is closed")
        tls = isinstance(sock, ssl.SSLSocket)
        fed = False
        total = 0
        while True:
            try:
                size = sock.recv_into(inbox)
            except (BlockingIOError, ssl.SSLWantReadError):
                return _POLLIN
            except ssl.SSLWantWriteError:  # TLS must send (a key update) before it reads
                return _POLLOUT
            except OSError as exc:  # ECONNRESET, a TLS alert, and friends
                raise _Closed(str(exc)) from exc
            if not size:
                if fed:
                    return _POLLIN
                raise _Closed("closed by the server")
            parser.feed(bytes(inbox[:size]))  # values are sliced out of bytes, not views
            fed = True
            if size < _RECV_SIZE and not tls:  # TLS: one record per recv, go on
                return _POLLIN
            total += size
            if total >= _RECV_SIZE:
                return 0

    def _parse(self) -> list[bytes | None] | None:
        """The oldest request's values if all its ``get`` lines were answered, else None."""
        get = self.pending[0]
        while not get.complete:
            try:
                reply = self.parser.next()
            except ProtocolViolation as exc:
                raise unexpected_reply(self.node, exc) from exc
            if reply is None:
                return None
            if not isinstance(reply, list):  # a get is answered with values or an error
                raise StoreError(f"memcached {self.node} answered get with {reply!s}")
            get.replies.append(reply)
        return get.values()

    def _accept(self, values: list[bytes | None]) -> list[bytes | None]:
        self.pending.popleft()
        self._may_retry = False
        self._answered = True
        return values

    def _retry_or_fail(self, exc: _Closed) -> None:
        """Resend what is pending on a fresh connection, once, when the close looks like
        the server's idle timeout; otherwise fail with StoreUnavailable."""
        if not self._may_retry:
            self._fail()
            raise StoreUnavailable(
                f"memcached connection to {self.node} failed: {exc}"
                f"{self._closed_hint()}") from exc
        self._may_retry = False
        self._close_socket()
        try:
            self._connect()
            for get in self.pending:
                get.replies.clear()
                self._send(get)
        except BaseException:
            self._fail()
            raise

    def _fail(self) -> None:
        """Forget what was in flight and close: a broken stream is never reused."""
        self.pending.clear()
        self._may_retry = False
        self._close_socket()

    def _timeout(self) -> StoreTimeout:
        self._fail()
        return no_answer(self.node, self.timeout)
