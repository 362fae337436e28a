"""Test and development support: local servers and the loopback fault proxy.

Not part of a cache's runtime: the demo, the benchmarks and the test suite start
``redis-server`` / ``valkey-server`` / ``memcached`` / a Redis Cluster with
`asynccache.testing.servers` (on free loopback ports, torn down on exit), and inject
latency, trickle, resets and black holes with `FaultProxy`. Its errors (`TestingError`) are
outside the ``CacheError`` tree, so that code handling a cache's failures never hides a
broken set-up.
"""

from __future__ import annotations

from .proxy import FaultProxy, url_through
from .servers import (
    LocalServer,
    MemcachedServer,
    RedisCluster,
    RedisServer,
    ServerNotFound,
    ServerStartError,
    TestingError,
    TlsFiles,
    find_memcached_binary,
    find_redis_binary,
    start_memcached,
    start_redis,
    start_redis_cluster,
)

__all__ = [
    "FaultProxy",
    "LocalServer",
    "MemcachedServer",
    "RedisCluster",
    "RedisServer",
    "ServerNotFound",
    "ServerStartError",
    "TestingError",
    "TlsFiles",
    "find_memcached_binary",
    "find_redis_binary",
    "start_memcached",
    "start_redis",
    "start_redis_cluster",
    "url_through",
]
