"""Where and how to connect: TLS settings, the Redis endpoint, and what a failed connection
means, shared by the asyncio connections and the consumer-side blocking ones.

The asyncio read connection, the consumer-side blocking connection and redis-py's pool
all need the same settings; frozen dataclasses keep them in one place (and keep the
password out of ``repr``).

TLS: a client keeps :class:`TlsSettings`, file *paths* and checks, never file contents
(it is pickled to DataLoader workers and into checkpoints). The ``SSLContext`` is built
from them once per process, the first time a connection needs it, and shared by every
connection with the same settings: loading a CA bundle costs milliseconds, and a context
cannot be pickled anyway.

Blocking TLS sockets (:func:`open_stream`, :func:`wait_ready`): the handshake is done
non-blocking within ``connect_timeout``, and a wait for readability first asks the SSL
object for decrypted bytes it already holds (``pending()``): those never make the
socket readable again, so polling first would wait for the deadline with the reply in
hand.
"""

from __future__ import annotations

import asyncio
import functools
import os
import select
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError, StoreError, StoreTimeout, StoreUnavailable
from ..protocol.resp import setup_commands

__all__ = [
    "RedisEndpoint",
    "TlsSettings",
    "close_transport",
    "closed_hint",
    "connect_failure",
    "open_stream",
    "readable_while_idle",
    "ssl_error_in",
    "wait_ready",
]

_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
              "none": ssl.CERT_NONE}
#: OpenSSL's verify codes for a certificate that does not name the host (DNS name / IP).
_NAME_MISMATCH = (62, 64)


@dataclass(frozen=True)
class TlsSettings:
    """How to set up TLS: the CA bundle to trust (``None``: the system's), the client
    certificate and key, whether the server's certificate is required and its name
    checked. Paths only: this travels with pickled clients."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = field(default=None, repr=False)
    cert_reqs: str = "required"
    check_hostname: bool = True

    def __post_init__(self) -> None:
        if self.cert_reqs not in _CERT_REQS:
            raise ConfigError(f"ssl_cert_reqs must be 'required', 'optional' or 'none', got "
                              f"{self.cert_reqs!r}")
        if self.keyfile is not None and self.certfile is None:
            raise ConfigError("ssl_keyfile is given without ssl_certfile: a client "
                              "certificate needs both (or one PEM file with both, as "
                              "ssl_certfile)")

    def check(self) -> None:
        """Raise ConfigError naming the option whose file is missing, unreadable or not a
        PEM file of the right kind. ``connect()`` calls this, so a typo fails there, in
        the caller, not later in a DataLoader worker."""
        for option, path in (("ssl_ca_certs", self.ca_certs), ("ssl_certfile", self.certfile),
                             ("ssl_keyfile", self.keyfile)):
            if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                raise ConfigError(f"{option}={path!r} is not a readable file")
        self.context()

    def context(self) -> ssl.SSLContext:
        """The client context for these settings, built once per process."""
        return _context(self)

    def redis_py_options(self) -> dict[str, Any]:
        """The same settings as redis-py's ``ssl_*`` keyword arguments."""
        return {"ssl": True, "ssl_ca_certs": self.ca_certs, "ssl_certfile": self.certfile,
                "ssl_keyfile": self.keyfile, "ssl_cert_reqs": self.cert_reqs,
                "ssl_check_hostname": self.check_hostname and self.cert_reqs != "none"}

    def trusted(self) -> str:
        """Which CAs are trusted, for messages."""
        if self.ca_certs is None:
            return "ssl_ca_certs is not set, so the system's CA store was used"
        return f"ssl_ca_certs={self.ca_certs}"


def _encrypted_key() -> str:
    # OpenSSL's default would prompt on the terminal: a DataLoader worker would hang
    raise ConfigError("ssl_keyfile (or ssl_certfile) holds an encrypted private key; "
                      "asynccache needs an unencrypted key file (readable only by you)")


@functools.cache
def _context(tls: TlsSettings) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=tls.ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"ssl_ca_certs={tls.ca_certs!r} cannot be loaded as PEM CA "
                          f"certificates: {exc}") from exc
    reqs = _CERT_REQS[tls.cert_reqs]
    context.check_hostname = False  # before verify_mode: CERT_NONE refuses it otherwise
    context.verify_mode = reqs
    context.check_hostname = tls.check_hostname and reqs != ssl.CERT_NONE
    if tls.certfile is not None:
        try:
            context.load_cert_chain(tls.certfile, tls.keyfile, password=_encrypted_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"ssl_certfile={tls.certfile!r} / ssl_keyfile: cannot load the "
                              f"client certificate and its key: {exc}") from exc
    return context


@dataclass(frozen=True)
class RedisEndpoint:
    host: str | None
    port: int | None
    unix_socket_path: str | None
    username: str | None
    password: str | None = field(repr=False)
    db: int
    timeout: float
    connect_timeout: float
    where: str  # the URL with the password masked: for messages and logs
    tls: TlsSettings | None = None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context (built once per process), or None for a plain connection."""
        return None if self.tls is None else self.tls.context()

    def setup_requests(self) -> list[bytes]:
        return setup_commands(self.username, self.password, self.db)

    @property
    def address(self) -> str | None:
        """``host:port`` (None for a unix socket), for messages that name another URL."""
        return None if self.unix_socket_path else f"{self.host}:{self.port}"

    def closed_hint(self, fresh: bool) -> str:
        """What to check when the server closed the connection (``fresh``: before it
        answered anything on it)."""
        if self.unix_socket_path:
            return ""
        return closed_hint(self.tls, fresh=fresh, tls_url="rediss:// (rediss+cluster:// for "
                           "a cluster) instead of redis://")

    def open_socket(self) -> socket.socket:
        """A connected non-blocking socket (TLS handshake done), TCP_NODELAY set, within
        ``connect_timeout``."""
        if not self.unix_socket_path:
            assert self.host is not None and self.port is not None
            return open_stream(self.host, self.port, tls=self.tls,
                               connect_timeout=self.connect_timeout, kind="redis",
                               where=self.where)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(self.unix_socket_path)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise connect_failure("redis", self.where, exc, None, self.connect_timeout) from exc
        return sock


def close_transport(transport: asyncio.BaseTransport) -> None:
    """Close an asyncio connection now. A TLS transport is aborted: ``close()`` would first
    exchange close_notify alerts with the server, which keeps the socket open for a round
    trip (up to the loop's SSL shutdown timeout, 30 s, with a dead server) and past the
    end of a loop that stops right after; a cache connection has nothing left to flush."""
    if transport.get_extra_info("sslcontext") is not None:
        transport.abort()  # type: ignore[attr-defined]
    else:
        transport.close()


# -- blocking sockets, plain or TLS --------------------------------------------------------
def open_stream(host: str, port: int, *, tls: TlsSettings | None, connect_timeout: float,
                kind: str, where: str) -> socket.socket:
    """A connected non-blocking TCP socket, wrapped in TLS (handshake done) when ``tls``
    is set; TCP connect and handshake together within ``connect_timeout``. Failures are
    StoreErrors that say what went wrong (see :func:`connect_failure`)."""
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


def ssl_error_in(exc: BaseException) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` behind ``exc`` (itself, or one it was raised from or during),
    if any: redis-py reports a failed handshake as its own ConnectionError."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, ssl.SSLError):
            return e
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return None


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
