"""Passwords out of the client, its pickles and every message.

A client keeps a `Credential`: where its password is (a process-local vault keyed
by a fingerprint of the URL without secrets, or an environment variable), never the
password, so a pickle carries none. `mask_url()` and `mask_text()` hide the
userinfo of store URLs in messages, found by the rule ``connect()`` splits URLs by (see
docs/security.md).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import threading
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["CREDENTIALS_ENV_PREFIX", "Credential", "mask_text", "mask_url", "query_of",
           "split_userinfo"]


# -- URLs: the userinfo found before anything else is parsed ---------------------------
# A password may hold any character (``/ ? # @ : %`` and spaces, written as is): the
# userinfo is everything between ``//`` and the *last* ``@`` of the URL (none when the
# part after ``//`` starts with ``/``, as in ``unix:///path``). A raw ``@`` elsewhere (an
# option value) must be written ``%40``.

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")
_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
MASK = "***"


def split_userinfo(rest: str) -> tuple[str | None, str]:
    """``(userinfo, the rest)`` of what follows a URL's ``//``; ``None`` without one."""
    if rest.startswith("/"):
        return None, rest
    userinfo, at, after = rest.rpartition("@")
    if not at:
        return None, rest
    return userinfo, after


def query_of(url: str) -> str:
    """The query string of ``url`` (after its userinfo, which may hold a ``?``)."""
    _scheme, sep, rest = url.partition("://")
    if sep:
        _userinfo, rest = split_userinfo(rest)
    return rest.partition("?")[2].partition("#")[0]


def _masked(userinfo: str) -> str:
    user, colon, _password = userinfo.partition(":")
    return f"{user}:{MASK}" if colon else MASK


def _userinfo_of(text: str, start: int) -> tuple[int, tuple[str | None, str]]:
    """Where the userinfo of the URL whose ``//`` ends at ``start`` begins, and
    `split_userinfo()` of it. A mistyped URL with the credentials after the slashes
    (``redis:///:pw@host``, ``unix:///:pw@/path``) is read as if they came first: a mask
    may hide a path holding an ``@``, never let a password through."""
    rest = text[start:]
    if rest.startswith("/") and "@" in rest:
        start += len(rest) - len(rest.lstrip("/"))
        userinfo, _at, after = text[start:].rpartition("@")
        return start, (userinfo, after)
    return start, split_userinfo(rest)


def mask_url(url: str) -> str:
    """``url`` with its password (its whole userinfo when it has no ``:``) replaced by
    ``***``; a string without ``//`` (a mistyped URL) is masked up to its last ``@``."""
    if not isinstance(url, str):
        return url
    scheme = _SCHEME.match(url)
    start = scheme.end() if scheme else 0
    if url.startswith("//", start):
        start += 2
        start, (userinfo, after) = _userinfo_of(url, start)
    else:  # not a URL connect() parses: hide everything up to the last "@"
        userinfo, at, after = url[start:].rpartition("@")
        if not at:
            userinfo = None
    if userinfo is None:
        return url
    return f"{url[:start]}{_masked(userinfo)}@{after}"


def mask_text(text: str) -> str:
    """Every URL's userinfo in a free text masked (the last ``@`` after the first
    ``scheme://`` ends it, so this may mask more than the password, never less)."""
    for found in _URL_START.finditer(text):
        start, (userinfo, after) = _userinfo_of(text, found.end())
        if userinfo is not None:
            return f"{text[:start]}{_masked(userinfo)}@{after}"
    return text


# -- credentials: out of the client, its pickles and its reprs -------------------------------
#: A client created with a password exports it once, as ``CREDENTIALS_ENV_PREFIX +
#: fingerprint``, so that spawn/forkserver children (fresh interpreters, empty vault)
#: find it when they unpickle the client.
CREDENTIALS_ENV_PREFIX = "ASYNCCACHE_CREDENTIALS_"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: fingerprint -> password, for this process (a forked child inherits it)
_vault: dict[str, str] = {}
_vault_lock = threading.Lock()


@dataclass(frozen=True)
class Credential:
    """Where a client's password is, never the password: pickled with the client.

    Either ``fingerprint`` (the password is in this process' vault, or in the variable
    ``CREDENTIALS_ENV_PREFIX + fingerprint`` that the creating process exported) or
    ``env`` (the user's own variable, ``password_env``; nothing is exported).
    """

    fingerprint: str | None = None
    env: str | None = None

    @classmethod
    def keep(cls, where: str, password: str | None, password_env: str | None
             ) -> Credential | None:
        """Put ``password`` in the vault (and the environment) under a fingerprint of
        ``where``, the URL without secrets; or check that ``password_env`` is set."""
        if password_env is not None:
            if password is not None:
                raise ConfigError(f"{where}: give the password in the URL or through "
                                  "password_env, not both")
            if not _ENV_NAME.fullmatch(password_env):
                raise ConfigError(f"password_env={password_env!r} is not an environment "
                                  "variable name")
            if password_env not in os.environ:
                raise ConfigError(f"password_env={password_env}: that environment variable "
                                  f"is not set (it holds the password for {where})")
            return cls(env=password_env)
        if password is None:
            return None
        base = hashlib.sha256(where.encode()).hexdigest()[:16]
        with _vault_lock:
            # another password for the same URL (say, a wrong one in a test) gets a slot
            # of its own rather than replacing the first one's
            for n in itertools.count():
                fingerprint = base if n == 0 else f"{base}_{n}"
                name = CREDENTIALS_ENV_PREFIX + fingerprint
                held = _vault.get(fingerprint, os.environ.get(name))
                if held is None or held == password:
                    _vault[fingerprint] = password
                    if os.environ.get(name) != password:
                        os.environ[name] = password
                    return cls(fingerprint=fingerprint)
        raise AssertionError("unreachable")  # pragma: no cover

    def resolve(self, where: str) -> str:
        """The password, in this process; ConfigError saying how to provide it when this
        process cannot know it (a client unpickled from a checkpoint elsewhere)."""
        if self.env is not None:
            value = os.environ.get(self.env)
            if value is None:
                raise ConfigError(
                    f"the password for {where} is read from the environment variable "
                    f"{self.env} (password_env), which is not set in this process "
                    f"(pid {os.getpid()}): set it wherever the client is used")
            return value
        assert self.fingerprint is not None
        value = _vault.get(self.fingerprint)
        if value is None:
            name = CREDENTIALS_ENV_PREFIX + self.fingerprint
            value = os.environ.get(name)
            if value is None:
                raise ConfigError(
                    f"the password for {where} is not known in this process (pid "
                    f"{os.getpid()}): a pickled client carries no password, and this "
                    f"process did not inherit {name} from the one that created the client "
                    "(e.g. it was loaded from a checkpoint, or started by a forkserver "
                    "that was already running). Keep the password in an environment "
                    "variable set in every process and pass password_env='THAT_VARIABLE' "
                    f"to connect() (or ?password_env= in the URL), or set {name} here")
            with _vault_lock:
                _vault[self.fingerprint] = value
        return value
