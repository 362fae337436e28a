"""Sentinels: named singletons that say "no value here" in one of several ways (h11's shape).

``class MISSING(Sentinel, metaclass=Sentinel): pass`` makes ``MISSING`` its own class and
its only instance: it compares by identity, its ``repr`` is its name, and it pickles by
reference to its module, so a copy that crossed a process boundary is the same object.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Sentinel"]


class Sentinel(type):
    def __new__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any],
                **kwds: Any) -> Sentinel:
        assert bases == (Sentinel,), "write: class NAME(Sentinel, metaclass=Sentinel)"
        made = super().__new__(cls, name, bases, namespace, **kwds)
        made.__class__ = made  # type: ignore[assignment]
        return made

    def __repr__(self) -> str:
        return self.__name__
