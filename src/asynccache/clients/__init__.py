"""Store clients: one small class per kind of store, all behind :class:`BaseClient`."""

from __future__ import annotations

from typing import Any

from .base import BaseClient
from .memcached import MemcachedClient
from .memory import MemoryClient
from .redis import RedisClient

__all__ = ["BaseClient", "MemcachedClient", "MemoryClient", "RedisClient", "RedisClusterClient"]


def __getattr__(name: str) -> Any:
    """The cluster client imports redis-py (its slot map): only when it is used."""
    if name == "RedisClusterClient":
        from .cluster import RedisClusterClient

        return RedisClusterClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
