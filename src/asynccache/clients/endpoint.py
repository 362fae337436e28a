"""Where and how to connect to one Redis-protocol server: one object, passed everywhere.

The asyncio read connection, the consumer-side blocking connection and redis-py's pool
all need the same settings; a frozen dataclass keeps them in one place (and keeps the
password out of ``repr``).
"""

from __future__ import annotations

import functools
import socket
import ssl
from dataclasses import dataclass, field

from ..errors import ConfigError, StoreTimeout, StoreUnavailable
from ..protocol.resp import setup_commands

__all__ = ["RedisEndpoint"]


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
    tls: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = field(default=None, repr=False)
    ssl_cert_reqs: str = "required"
    ssl_check_hostname: bool = True

    @functools.cached_property
    def _context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        reqs = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
                "none": ssl.CERT_NONE}.get(self.ssl_cert_reqs)
        if reqs is None:
            raise ConfigError(f"ssl_cert_reqs must be 'required', 'optional' or 'none', got "
                              f"{self.ssl_cert_reqs!r}")
        try:
            context = ssl.create_default_context(cafile=self.ssl_ca_certs)
            context.check_hostname = self.ssl_check_hostname and reqs != ssl.CERT_NONE
            context.verify_mode = reqs
            if self.ssl_certfile:
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot set up TLS for {self.where}: {exc}; check ssl_ca_certs, "
                              "ssl_certfile and ssl_keyfile") from exc
        return context

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context (built once), or None for a plain connection."""
        return self._context

    def setup_requests(self) -> list[bytes]:
        return setup_commands(self.username, self.password, self.db)

    def open_socket(self) -> socket.socket:
        """A connected blocking socket (bounded by ``connect_timeout``), TCP_NODELAY set."""
        try:
            if self.unix_socket_path:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.connect_timeout)
                    sock.connect(self.unix_socket_path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((self.host, self.port), self.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError as exc:
            raise StoreTimeout(f"connecting to redis {self.where} took over "
                               f"{self.connect_timeout:g}s") from exc
        except OSError as exc:
            raise StoreUnavailable(f"cannot connect to redis {self.where}: {exc}") from exc
        return sock
