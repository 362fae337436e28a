"""Where and how to connect: one `Endpoint` (host and port or a unix socket, TLS,
timeouts, the name used in messages) for every connection, blocking or asyncio, and what
a failed connection means."""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import StoreError, StoreTimeout, StoreUnavailable
from .tls import TlsSettings

__all__ = ["Endpoint", "closed_hint", "connect_failure", "open_stream", "readable_while_idle",
           "wait_ready"]

#: OpenSSL's verify codes for a certificate that does not name the host (DNS name / IP).
_NAME_MISMATCH = (62, 64)


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """One server: how to reach it, how long to wait, and how to name it in messages.

    ``kind`` (``"redis"``, ``"memcached"``) and ``where`` (its URL or ``host:port``,
    password masked) start every message; ``tls_url`` is what to connect with when a
    plain connection reaches a TLS port."""

    kind: str
    where: str
    host: str | None = None
    port: int | None = None
    unix_socket_path: str | None = None
    tls: TlsSettings | None = None
    timeout: float = 1.0
    connect_timeout: float = 1.0
    tls_url: str = ""

    @property
    def address(self) -> str | None:
        """``host:port`` (None for a unix socket), for messages that name another URL."""
        return None if self.unix_socket_path else f"{self.host}:{self.port}"

    def setup_requests(self) -> list[bytes]:
        """What a new connection sends before anything else (Redis: AUTH, SELECT)."""
        return []

    def closed_hint(self, fresh: bool) -> str:
        """What to check when the server closed the connection (``fresh``: before it
        answered anything on it)."""
        if self.unix_socket_path:
            return ""
        return closed_hint(self.tls, fresh=fresh, tls_url=self.tls_url)

    def connect_failure(self, exc: BaseException) -> StoreError:
        return connect_failure(self.kind, self.where, exc, self.tls, self.connect_timeout)

    def no_answer(self, what: str = "answer") -> StoreTimeout:
        return StoreTimeout(f"{self.kind} {self.where} did not {what} within "
                            f"{self.timeout:g}s; raise `timeout=` in connect() if the store "
                            "is just slow")

    def broken(self, exc: BaseException | str, fresh: bool) -> StoreUnavailable:
        """The connection failed (reset, closed, a TLS alert)."""
        return StoreUnavailable(f"{self.kind} connection to {self.where} failed: {exc}"
                                f"{self.closed_hint(fresh)}")

    def open_socket(self) -> socket.socket:
        """A connected non-blocking socket (TLS handshake done, TCP_NODELAY set), within
        ``connect_timeout``."""
        if not self.unix_socket_path:
            assert self.host is not None and self.port is not None
            return open_stream(self.host, self.port, tls=self.tls,
                               connect_timeout=self.connect_timeout, kind=self.kind,
                               where=self.where)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(self.unix_socket_path)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise self.connect_failure(exc) from exc
        return sock

    async def open_connection(self, protocol: Callable[[], asyncio.BaseProtocol]) -> None:
        """Connect ``protocol()`` in the running loop, within ``connect_timeout``."""
        loop = asyncio.get_running_loop()
        try:
            if self.unix_socket_path:
                coro: Any = loop.create_unix_connection(protocol, self.unix_socket_path)
            else:
                assert self.host is not None and self.port is not None
                context = None if self.tls is None else self.tls.context()
                coro = loop.create_connection(
                    protocol, self.host, self.port, ssl=context,
                    server_hostname=self.host if context is not None else None)
            await asyncio.wait_for(coro, self.connect_timeout)
        except (asyncio.TimeoutError, OSError) as exc:  # ssl.SSLError is an OSError
            raise self.connect_failure(exc) from exc


# -- blocking sockets, plain or TLS --------------------------------------------------------
def open_stream(host: str, port: int, *, tls: TlsSettings | None, connect_timeout: float,
                kind: str, where: str) -> socket.socket:
    """A connected non-blocking TCP socket, wrapped in TLS (handshake done) when ``tls``
    is set; TCP connect and handshake together within ``connect_timeout``. Failures are
    StoreErrors that say what went wrong (see `connect_failure()`)."""
    deadline = time.monotonic() + connect_timeout
    try:
        sock = socket.create_connection((host, port), connect_timeout)
    except OSError as exc:
        raise connect_failure(kind, where, exc, tls, connect_timeout) from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        if tls is not None:
            sock = tls.context().wrap_socket(sock, server_hostname=host,
                                             do_handshake_on_connect=False)
            _handshake(sock, deadline)
    except OSError as exc:
        sock.close()
        raise connect_failure(kind, where, exc, tls, connect_timeout) from exc
    return sock


def _handshake(sock: ssl.SSLSocket, deadline: float) -> None:
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            events = select.POLLIN
        except ssl.SSLWantWriteError:
            events = select.POLLOUT
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not wait_ready(sock, events, remaining):
            raise TimeoutError("the TLS handshake did not complete")


def wait_ready(sock: socket.socket, events: int, timeout: float) -> bool:
    """Wait at most ``timeout`` s for ``sock`` to be ready for ``events``; True if it is.

    A TLS socket whose SSL object already holds decrypted bytes counts as readable: the
    kernel has handed them over, so ``poll()`` would not wake up for them.
    """
    if events & select.POLLIN and isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, events | select.POLLERR | select.POLLHUP)
    # a millisecond more rounds the wait up past the deadline; a check (0) does not wait
    return bool(poller.poll(timeout * 1000 + 1 if timeout > 0 else 0))


def readable_while_idle(sock: socket.socket) -> bool:
    """True when a connection with nothing in flight became readable: the server closed
    it (e.g. its idle timeout) or sent bytes nobody asked for. On TLS, records without
    data (TLS 1.3 session tickets, a key update) make the socket readable too; they are
    consumed here and do not count."""
    try:
        if not wait_ready(sock, select.POLLIN, 0):
            return False
    except (OSError, ValueError):
        return True
    if not isinstance(sock, ssl.SSLSocket):
        return True
    try:
        sock.recv(1)  # data or EOF: the connection is replaced either way
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return False
    except OSError:
        return True
    return True


# -- what a failed connection means --------------------------------------------------------
def closed_hint(tls: TlsSettings | None, *, fresh: bool = False, tls_url: str = "") -> str:
    """Why a server may close a connection it has just accepted.

    Without TLS, closed (or reset) before it answered anything (``fresh``): a TLS-only
    port reads the plain request as a broken handshake and hangs up; ``tls_url`` says
    what to connect with instead. With TLS 1.3 the client's handshake is over before the
    server has checked the client's certificate, so a refused (or missing) one shows up
    as the connection closing at its first read."""
    if tls is None:
        return (f"; it closed before answering anything: if this port serves TLS, use "
                f"{tls_url}" if fresh and tls_url else "")
    if tls.certfile is not None:
        return ""
    return ("; a TLS server that requires client certificates closes the connection of a "
            "client without one: pass ssl_certfile and ssl_keyfile")


def connect_failure(kind: str, where: str, exc: BaseException, tls: TlsSettings | None,
                    connect_timeout: float) -> StoreError:
    """The StoreError for a connection attempt that raised ``exc`` (an OSError, an
    ``ssl.SSLError`` or a timeout), saying what to check: a certificate the client does
    not trust is a TLS verification failure naming ``ssl_ca_certs``, not "cannot
    connect"."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = exc.verify_message or exc.reason or str(exc)
        if exc.verify_code in _NAME_MISMATCH:
            advice = ("its certificate does not name the host connected to "
                      "(ssl_check_hostname=true): connect by a name or address in its "
                      "subjectAltName, or pass ssl_check_hostname=false (the certificate "
                      f"is still verified against the CA; {tls.trusted() if tls else ''})")
        else:
            advice = ("its certificate is not signed by a CA the client trusts "
                      f"({tls.trusted() if tls else 'no TLS settings'}): pass ssl_ca_certs="
                      "/path/to/the server's CA bundle")
        return StoreUnavailable(f"TLS verification failed for {kind} {where}: {reason}; "
                                f"{advice}")
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or str(exc)
        hint = ""
        if "WRONG_VERSION_NUMBER" in str(exc) or "RECORD_LAYER" in str(exc):
            hint = "; the server does not seem to speak TLS on this port"
        elif "CERTIFICATE" in str(exc).upper() or "HANDSHAKE_FAILURE" in str(exc):
            hint = ("; if the server requires a client certificate, pass ssl_certfile and "
                    "ssl_keyfile")
        return StoreUnavailable(f"TLS handshake with {kind} {where} failed: {reason}{hint}")
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        during = (" (TCP connect and TLS handshake: a server that does not speak TLS on "
                  "this port never answers the handshake)" if tls else "")
        return StoreTimeout(f"connecting to {kind} {where} took over {connect_timeout:g}s"
                            f"{during}")
    return StoreUnavailable(f"cannot connect to {kind} {where}: {exc}")
