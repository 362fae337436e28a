"""TLS settings: file paths and checks, never file contents (a client is pickled to
DataLoader workers and into checkpoints); the ``SSLContext`` is built from them once per
process, the first time a connection needs it, and shared by every connection with the
same settings (loading a CA bundle costs milliseconds)."""

from __future__ import annotations

import functools
import os
import ssl
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError

__all__ = ["TlsSettings", "ssl_error_in"]

_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
              "none": ssl.CERT_NONE}


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
