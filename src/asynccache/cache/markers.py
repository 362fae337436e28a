"""What travels with values between the layers instead of a value (never returned to users).

``MISSING``: not in the store, or unusable: compute it (also "not given" for a
``default`` or ``ttl`` argument; ``None`` is a value). ``NOT_READ`` (the store's): the
store was not asked or did not answer: read-ahead drops it, a direct read treats it as
``MISSING``. `Failed`: raise mode, this key's bytes failed to decode; raised where it
is consumed.
"""

from __future__ import annotations

from typing import Any

from .._sentinel import Sentinel
from ..errors import CacheError
from ..store.api import NOT_READ

__all__ = ["MISSING", "NOT_READ", "Failed", "is_value"]


class MISSING(Sentinel, metaclass=Sentinel):
    """Not given / not in the cache (``None`` is a valid value): ``await cache.get(key,
    MISSING)`` tells a miss from a cached ``None``."""


class Failed:
    """A value that failed to decode, in raise mode: raised where it is consumed."""

    __slots__ = ("error",)

    def __init__(self, error: CacheError) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"Failed({self.error!r})"


def is_value(value: Any) -> bool:
    """A read that found a usable value: not a miss, not unread, not a failure."""
    return value is not MISSING and value is not NOT_READ and type(value) is not Failed
