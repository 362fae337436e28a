"""Pipelined ``MGET`` on a plain socket, driven by the consumer thread itself.

Why this exists next to the asyncio core: with read-ahead on the loop thread, the
consumer (the training loop calling ``dp[i]``) and the loop thread take turns on the
GIL. A loop thread woken by a reply waits for the consumer to block before it can parse
it, so the two threads' costs add up and the consumer stalls once per batch; measured on
the CI machine, that path peaked at about half the throughput of a plain single-threaded
asyncio ``MGET`` loop (issue notes). Here the consumer sends the read-ahead requests
itself (``sendall`` of a few KB) and parses whatever replies have arrived, without
blocking, each time it tops up the window; it blocks on the socket only when the very
index it needs is still on the wire. No thread hop, no GIL hand-off, no per-item cost
beyond a ``dict.pop``.

Used by the prefetcher for plain (non-TLS) Redis and Valkey, over TCP or a unix socket.
Everything else — writes, misses, chunked values, memcached, clusters — stays on the
asyncio core. Failures raise :class:`~asynccache.errors.StoreError` subclasses; the
caller counts them and turns them into misses.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import hiredis

from ..errors import StoreError, StoreTimeout, StoreUnavailable
from .resp import pack_mget, setup_commands, setup_refused

__all__ = ["BlockingRespReader"]

_RECV_SIZE = 1 << 18


class BlockingRespReader:
    """One socket, many MGETs in flight, replies matched to requests in order."""

    def __init__(self, *, host: str | None, port: int | None, unix_socket_path: str | None,
                 username: str | None, password: str | None, db: int, timeout: float,
                 connect_timeout: float, where: str) -> None:
        self.host, self.port, self.unix_socket_path = host, port, unix_socket_path
        self.username, self.password, self.db = username, password, db
        self.timeout, self.connect_timeout, self.where = timeout, connect_timeout, where
        self.sock: socket.socket | None = None
        self.parser = hiredis.Reader()

    # -- connection ---------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        try:
            if self.unix_socket_path:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.connect_timeout)
                sock.connect(self.unix_socket_path)
            else:
                sock = socket.create_connection((self.host, self.port), self.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError as exc:
            raise StoreTimeout(f"connecting to redis {self.where} took over "
                               f"{self.connect_timeout:g}s") from exc
        except OSError as exc:
            raise StoreUnavailable(f"cannot connect to redis {self.where}: {exc}") from exc
        sock.settimeout(self.timeout)
        self.sock, self.parser = sock, hiredis.Reader()
        for request in setup_commands(self.username, self.password, self.db):
            self._send(request)
            refused = setup_refused(self.where, [self._receive(block=True)])
            if refused is not None:
                self.close()
                raise refused
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None

    # -- requests and replies -----------------------------------------------------------
    def _send(self, data: bytes) -> None:
        sock = self.sock or self._connect()
        try:
            sock.sendall(data)
        except TimeoutError as exc:
            self.close()
            raise StoreTimeout(f"redis {self.where} did not take a request within "
                               f"{self.timeout:g}s") from exc
        except OSError as exc:
            self.close()
            raise StoreUnavailable(f"redis connection to {self.where} failed: {exc}") from exc

    def send_mget(self, keys: Sequence[bytes]) -> None:
        """Queue one MGET; its reply comes back, in order, from :meth:`receive`."""
        self._send(pack_mget(keys))

    def _receive(self, block: bool, recv: bool = True) -> Any:
        """The next reply; ``False`` if none has fully arrived (not blocking) or, with
        ``recv=False``, if none can be parsed from the bytes already received."""
        reply = self._parse()
        while reply is False and recv:
            if self.sock is None:
                raise StoreUnavailable(f"redis connection to {self.where} is closed")
            try:
                data = self.sock.recv(_RECV_SIZE) if block else \
                    self.sock.recv(_RECV_SIZE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except TimeoutError as exc:
                self.close()
                raise StoreTimeout(f"redis {self.where} did not answer within "
                                   f"{self.timeout:g}s; raise `timeout=` in connect() if "
                                   "the store is just slow") from exc
            except OSError as exc:
                self.close()
                raise StoreUnavailable(f"redis connection to {self.where} failed: {exc}") \
                    from exc
            if not data:
                self.close()
                raise StoreUnavailable(f"redis {self.where} closed the connection")
            self.parser.feed(data)
            reply = self._parse()
        return reply

    def _parse(self) -> Any:
        try:
            return self.parser.gets()
        except hiredis.ProtocolError as exc:
            self.close()
            raise StoreError(f"redis {self.where} sent an unexpected reply: {exc}") from exc

    def receive_mget(self, block: bool, recv: bool = True) -> list[bytes | None] | bool:
        """The next MGET reply (see :meth:`_receive` for ``block`` and ``recv``)."""
        reply = self._receive(block, recv)
        if isinstance(reply, hiredis.ReplyError):
            raise StoreError(f"redis {self.where} answered MGET with an error: {reply}")
        return reply
