"""Store clients: one small class per kind of store, all behind :class:`BaseClient`."""

from __future__ import annotations

from .base import BaseClient
from .cluster import RedisClusterClient
from .memcached import MemcachedClient
from .memory import MemoryClient
from .redis import RedisClient

__all__ = ["BaseClient", "MemcachedClient", "MemoryClient", "RedisClient", "RedisClusterClient"]
