"""The blocking transport against a scripted socket: no server.

As httpcore tests its HTTP/1.1 connection on a ``MockStream``, the Redis and memcached
consumer connections run here on a :class:`ScriptedSocket` that hands out replies in
the pieces a test chooses: partial reads, a reply split across reads, ``EAGAIN``, a
reset mid-reply, a deadline passing, TLS asking to read first. Only readiness is real:
the socket's ``fileno`` is one end of a socketpair, made readable when the script has
something to say, so the transport's ``poll()`` waits exactly as it would on a server.
"""

from __future__ import annotations

import collections
import socket
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

import asynccache as ac
from asynccache.store.memcached.consumer import BlockingMemcachedConnection
from asynccache.store.protocol.resp import pack_mget
from asynccache.store.redis.consumer import BlockingRespConnection
from asynccache.store.redis.endpoint import RedisEndpoint
from asynccache.store.transport.endpoint import Endpoint
from asynccache.store.transport.tls import TlsSettings

#: a script step: bytes to receive (cut to the caller's buffer, the rest kept for the
#: next read), b"" for the end of the stream, or an exception to raise
Step = bytes | BaseException


class ScriptedSocket:
    """Answers ``recv_into`` from a script; records what is sent. Readable (for
    ``poll()``) exactly while the script has a step left."""

    def __init__(self, script: Iterable[Step] = (), *, send_limit: int | None = None,
                 send_blocks: int = 0) -> None:
        self.script: collections.deque[Step] = collections.deque()
        self.sent = bytearray()
        self.closed = False
        self.send_limit = send_limit    # at most this many bytes per send()
        self.send_blocks = send_blocks  # so many send() calls raise BlockingIOError first
        self._mine, self._peer = socket.socketpair()
        self._readable = False
        self.arrive(*script)

    def arrive(self, *steps: Step) -> None:
        """More of the script: what the server sends next."""
        self.script.extend(steps)
        self._signal()

    def _signal(self) -> None:
        if self.script and not self._readable:
            self._peer.send(b"!")
        elif not self.script and self._readable:
            self._mine.recv(1)
        self._readable = bool(self.script)

    def fileno(self) -> int:
        return self._mine.fileno()

    def send(self, data: Any) -> int:
        if self.send_blocks:
            self.send_blocks -= 1
            raise BlockingIOError
        chunk = bytes(data)[: self.send_limit]
        self.sent += chunk
        return len(chunk)

    def recv_into(self, view: memoryview) -> int:
        if not self.script:
            raise BlockingIOError  # nothing has arrived yet
        step = self.script.popleft()
        try:
            if isinstance(step, BaseException):
                raise step
            n = min(len(step), len(view))
            view[:n] = step[:n]
            if n < len(step):
                self.script.appendleft(step[n:])
            return n
        finally:
            self._signal()

    def close(self) -> None:
        self.closed = True
        self._mine.close()
        self._peer.close()

    def __del__(self) -> None:
        self._mine.close()
        self._peer.close()


@dataclass(frozen=True, kw_only=True)
class ScriptedRedis(RedisEndpoint):
    """A Redis endpoint whose connections are the given sockets, one per connect."""

    sockets: list[ScriptedSocket] = field(default_factory=list, compare=False)

    def open_socket(self) -> Any:
        if not self.sockets:
            raise ac.StoreUnavailable("no more scripted connections")
        return self.sockets.pop(0)


@dataclass(frozen=True, kw_only=True)
class ScriptedMemcached(Endpoint):
    sockets: list[ScriptedSocket] = field(default_factory=list, compare=False)

    def open_socket(self) -> Any:
        return self.sockets.pop(0)


def redis(*sockets: ScriptedSocket, timeout: float = 1.0, **options: Any
          ) -> BlockingRespConnection:
    endpoint = ScriptedRedis(where="redis://scripted/0", host="scripted", port=1,
                             timeout=timeout, sockets=list(sockets), **options)
    return BlockingRespConnection(endpoint)


def memcached(*sockets: ScriptedSocket, timeout: float = 1.0) -> BlockingMemcachedConnection:
    endpoint = ScriptedMemcached(kind="memcached", where="scripted:1", host="scripted",
                                 port=1, timeout=timeout, sockets=list(sockets))
    return BlockingMemcachedConnection(endpoint, max_value=1 << 20)


def mget_reply(*values: bytes | None) -> bytes:
    parts = [b"*%d\r\n" % len(values)]
    for value in values:
        parts.append(b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value))
    return b"".join(parts)


def test_replies_come_back_in_order_whatever_pieces_they_arrive_in() -> None:
    stream = mget_reply(b"a", None) + mget_reply(b"bb") + mget_reply(b"", b"ccc")
    pieces: list[Step] = [stream[i:i + 3] for i in range(0, len(stream), 3)]
    sock = ScriptedSocket(pieces)
    conn = redis(sock)
    for keys in ([b"k1", b"k2"], [b"k3"], [b"k4", b"k5"]):
        conn.send_get(keys)
    assert bytes(sock.sent) == b"".join(pack_mget(k) for k in ([b"k1", b"k2"], [b"k3"],
                                                              [b"k4", b"k5"]))
    assert conn.receive() == [b"a", None]
    assert conn.receive() == [b"bb"]
    assert conn.receive() == [b"", b"ccc"]
    assert not conn.pending and not sock.script


def test_poll_never_blocks_and_stops_at_its_limit() -> None:
    reply = mget_reply(b"x")
    sock = ScriptedSocket([reply[:4]])
    conn = redis(sock)
    conn.send_get([b"k"])
    conn.send_get([b"k"])
    assert conn.poll() == []  # half a reply, then EAGAIN: nothing complete yet
    sock.arrive(reply[4:] + reply + reply)
    assert conn.poll(limit=1) == [[b"x"]]
    assert len(conn.pending) == 1
    assert conn.poll() == [[b"x"]]


def test_eagain_between_pieces_is_waited_for() -> None:
    reply = mget_reply(b"value")
    sock = ScriptedSocket([reply[:5], BlockingIOError(), BlockingIOError(), reply[5:]])
    conn = redis(sock)
    conn.send_get([b"k"])
    assert conn.receive() == [b"value"]


def test_a_reset_mid_reply_fails_the_request_and_drops_what_is_queued() -> None:
    reply = mget_reply(b"value")
    sock = ScriptedSocket([reply + reply[:6], ConnectionResetError("reset by peer")])
    conn = redis(sock)
    conn.send_get([b"a"])
    conn.send_get([b"b"])
    conn.send_get([b"c"])
    assert conn.receive() == [b"value"]  # answered before the reset: handed out
    with pytest.raises(ac.StoreUnavailable, match="reset by peer"):
        conn.receive()
    assert sock.closed and not conn.pending and not conn.stash
    with pytest.raises(ac.StoreError, match="no request pending"):
        conn.receive()  # nothing of the old stream survives


def test_an_idle_close_is_retried_once_on_a_fresh_connection() -> None:
    first = ScriptedSocket([b""])  # the server closed it while idle
    second = ScriptedSocket([mget_reply(b"v")])
    conn = redis(first, second)
    conn.send_get([b"k"])
    assert conn.receive() == [b"v"]
    assert first.closed and bytes(second.sent) == pack_mget([b"k"])
    # closed after answering one of the requests in flight: a failure, not idleness
    conn.send_get([b"k"])
    conn.send_get([b"k"])
    second.arrive(mget_reply(b"1"), b"")
    assert conn.receive() == [b"1"]
    with pytest.raises(ac.StoreUnavailable, match="closed by the server"):
        conn.receive()


def test_a_connection_closed_while_idle_is_replaced_before_sending() -> None:
    first = ScriptedSocket([mget_reply(b"v")])
    second = ScriptedSocket([mget_reply(b"w")])
    conn = redis(first, second)
    conn.send_get([b"k"])
    assert conn.receive() == [b"v"]
    first.arrive(b"")  # readable while nothing is in flight: the server closed it
    conn.send_get([b"k"])
    assert first.closed and conn.receive() == [b"w"]


def test_a_close_before_anything_was_answered_twice_is_a_failure() -> None:
    conn = redis(ScriptedSocket([b""]), ScriptedSocket([b""]))
    conn.send_get([b"k"])
    with pytest.raises(ac.StoreUnavailable, match="closed"):
        conn.receive()


def test_a_deadline_passing_fails_the_request_once() -> None:
    sock = ScriptedSocket()  # the server never answers
    conn = redis(sock, timeout=0.05)
    conn.send_get([b"k"])
    started = time.monotonic()
    with pytest.raises(ac.StoreTimeout, match=r"did not answer within 0\.05s"):
        conn.receive()
    assert time.monotonic() - started < 1.0
    assert sock.closed and not conn.pending


def test_poll_past_the_deadline_times_out_without_waiting() -> None:
    sock = ScriptedSocket()
    conn = redis(sock, timeout=0.01)
    conn.send_get([b"k"])
    time.sleep(0.02)
    with pytest.raises(ac.StoreTimeout):
        conn.poll()
    assert sock.closed


def test_a_consumer_that_was_away_gets_its_deadlines_extended() -> None:
    sock = ScriptedSocket()
    conn = redis(sock, timeout=0.01)
    conn.send_get([b"k"])
    time.sleep(0.02)
    conn.extend_deadlines(time.monotonic() + 5)
    assert conn.poll() == []  # not timed out: the reply may be in the kernel still
    sock.arrive(mget_reply(b"late"))
    assert conn.receive() == [b"late"]


def test_tls_wants_to_read_first_and_to_write_first() -> None:
    reply = mget_reply(b"secret")
    sock = ScriptedSocket([reply[:3], ssl.SSLWantReadError(), ssl.SSLWantWriteError(),
                           reply[3:]], send_blocks=1)
    conn = redis(sock, tls=TlsSettings())
    conn.send_get([b"k"])  # the first send blocked: waited for, then sent whole
    assert bytes(sock.sent) == pack_mget([b"k"])
    assert conn.receive() == [b"secret"]


def test_a_request_sent_in_pieces_arrives_whole() -> None:
    sock = ScriptedSocket([mget_reply(*[b"v"] * 50)], send_limit=5)
    conn = redis(sock)
    keys = [b"key-%d" % i for i in range(50)]
    conn.send_get(keys)
    assert bytes(sock.sent) == pack_mget(keys)
    assert conn.receive() == [b"v"] * 50


def test_garbage_fails_the_connection() -> None:
    sock = ScriptedSocket([b"&garbage\r\n"])
    conn = redis(sock)
    conn.send_get([b"k"])
    with pytest.raises(ac.StoreError, match="unexpected reply"):
        conn.receive()
    assert sock.closed and not conn.pending


def test_setup_commands_go_first_and_a_refusal_is_said() -> None:
    sock = ScriptedSocket([b"-WRONGPASS invalid username-password pair\r\n"])
    conn = redis(sock, password="pw")
    with pytest.raises(ac.StoreUnavailable, match="refused the credentials"):
        conn.send_get([b"k"])
    assert sock.sent.startswith(b"*2\r\n$4\r\nAUTH\r\n") and sock.closed


def test_memcached_values_in_pieces_and_repeated_keys() -> None:
    stream = b"VALUE a 0 2\r\nxy\r\nVALUE b 0 0\r\n\r\nEND\r\n"
    sock = ScriptedSocket([stream[i:i + 4] for i in range(0, len(stream), 4)])
    conn = memcached(sock)
    conn.send_get([b"a", b"b", b"a", b"c"])
    assert bytes(sock.sent) == b"get a b c\r\n"  # each distinct key asked once
    assert conn.receive() == [b"xy", b"", b"xy", None]


def test_memcached_reset_mid_reply_and_a_stray_value() -> None:
    sock = ScriptedSocket([b"END\r\nVALUE a 0 2\r\nx", ConnectionResetError("reset")])
    conn = memcached(sock)
    conn.send_get([b"z"])
    conn.send_get([b"a"])
    assert conn.receive() == [None]
    with pytest.raises(ac.StoreUnavailable, match="reset"):
        conn.receive()
    assert sock.closed and not conn.pending
    stray = ScriptedSocket([b"VALUE other 0 1\r\nx\r\nEND\r\n"])
    conn = memcached(stray)
    conn.send_get([b"mine"])
    with pytest.raises(ac.StoreError, match="not asked for"):
        conn.receive()
    assert stray.closed


def test_memcached_idle_close_retried_with_a_fresh_parser() -> None:
    first = ScriptedSocket([b"VALUE a 0 1\r\n", b""])  # half a reply, then closed
    second = ScriptedSocket([b"VALUE a 0 1\r\nz\r\nEND\r\n"])
    conn = memcached(first, second)
    conn.send_get([b"a"])
    assert conn.receive() == [b"z"]
    assert bytes(second.sent) == b"get a\r\n"
