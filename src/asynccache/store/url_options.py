"""The words a URL option (or a keyword given as a string) may use for true and false.

One rule for every store: ``connect()``'s options and ``lmdb://``'s accept the same
words, and refuse anything else with the same message.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidURL

__all__ = ["flag"]

TRUE = frozenset({"true", "1", "yes", "on"})
FALSE = frozenset({"false", "0", "no", "off"})


def flag(name: str, raw: Any, where: str = "") -> bool:
    """``raw`` (a bool, or one of the words above in any case) as a bool; `InvalidURL`
    otherwise, naming the option and ``where`` it was given (a URL, masked)."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in TRUE | FALSE:
        return text in TRUE
    given = f" for {where}" if where else ""
    raise InvalidURL(f"option {name}={raw!r}{given} is not true or false")
