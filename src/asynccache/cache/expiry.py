"""The one TTL rule, for every call and every store.

``ttl`` is a number of seconds (``int`` or ``float``) or a `datetime.timedelta`;
``None`` means no expiry. Zero, negative, NaN and infinite values are a
`ConfigError` wherever a ttl is accepted (the constructor, each
``set``/``set_many``/``get_or_compute`` call, the pipe and the node): a store would
otherwise read them three different ways (Redis: expire at once; memcached: never, or
"an absolute Unix time"). Stores receive a positive ``float``; one that counts whole
seconds (memcached) rounds up, so a value lives at least as long as asked.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from ..errors import ConfigError

__all__ = ["check_ttl"]


def check_ttl(ttl: Any, what: str = "ttl") -> float | None:
    """``ttl`` as positive seconds, or None; ConfigError saying what is accepted."""
    if ttl is None:
        return None
    if isinstance(ttl, datetime.timedelta):
        seconds = ttl.total_seconds()
    elif isinstance(ttl, int | float) and not isinstance(ttl, bool):
        seconds = float(ttl)
    else:
        raise ConfigError(f"{what} must be seconds (int or float), a datetime.timedelta or "
                          f"None, got {type(ttl).__name__} {ttl!r:.40}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{what} must be a positive, finite duration (None: no expiry), "
                          f"got {ttl!r}")
    return seconds
