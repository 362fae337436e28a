"""Passwords out of every message: the userinfo of a store URL, found before anything
else of the URL is parsed.

A password may hold any character, ``/ ? # @ : %`` and spaces included, written as is
(many people do not percent-encode). So the userinfo is everything between ``//`` and
the *last* ``@`` of the URL (unless the part after ``//`` starts with ``/``: then there
is none, as in ``unix:///path``). :func:`asynccache.connect` splits URLs by the same
rule, so what is masked here is exactly what it takes as the credentials. A raw ``@``
elsewhere (an option value) must be written ``%40``.
"""

from __future__ import annotations

import re

__all__ = ["mask_text", "mask_url", "query_of", "split_userinfo"]

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


def mask_url(url: str) -> str:
    """``url`` with its password (its whole userinfo when it has no ``:``) replaced by
    ``***``; a string without ``//`` (a mistyped URL) is masked up to its last ``@``."""
    if not isinstance(url, str):
        return url
    scheme = _SCHEME.match(url)
    start = scheme.end() if scheme else 0
    if url.startswith("//", start):
        start += 2
        userinfo, after = split_userinfo(url[start:])
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
        start = found.end()
        userinfo, after = split_userinfo(text[start:])
        if userinfo is not None:
            return f"{text[:start]}{_masked(userinfo)}@{after}"
    return text
