"""asynccache: an async key-value cache client with batched prefetching.

A shared remote store (Redis/Valkey, memcached, Redis Cluster) in place of the per-worker
dict cache of PyTorch pipelines, without a network round trip per item::

    import asynccache as ac

    client = ac.connect("redis://127.0.0.1:6379/0")
    dp = SequenceWrapper(items).map(expensive).async_kv_cache(client, prefetch=64)

    async with ac.AsyncKVCache(client, namespace="svc-v1") as cache:
        hits = await cache.get_many(["a", "b"])

Importing asynccache registers ``async_kv_cache`` on ``torch.utils.data.MapDataPipe``
when torch is installed.
"""

from __future__ import annotations

from .clients import BaseClient, MemcachedClient, MemoryClient, RedisClient, RedisClusterClient
from .codec import Codec
from .connect import connect
from .core import MISSING, AsyncKVCache
from .datapipe import AsyncKVCacheMapDataPipe, derive_namespace
from .errors import (
    CacheError,
    ConfigError,
    DecodeError,
    EncodeError,
    FormatMismatch,
    InvalidURL,
    KeyEncodingError,
    KeyTooLong,
    LoopError,
    MissingDependency,
    SignatureError,
    StoreError,
    StoreRejected,
    StoreTimeout,
    StoreUnavailable,
    Unsupported,
    ValueTooLarge,
)

__version__ = "0.1.0"

__all__ = [
    "MISSING",
    "AsyncKVCache",
    "AsyncKVCacheMapDataPipe",
    "BaseClient",
    "CacheError",
    "Codec",
    "ConfigError",
    "DecodeError",
    "EncodeError",
    "FormatMismatch",
    "InvalidURL",
    "KeyEncodingError",
    "KeyTooLong",
    "LoopError",
    "MemcachedClient",
    "MemoryClient",
    "MissingDependency",
    "RedisClient",
    "RedisClusterClient",
    "SignatureError",
    "StoreError",
    "StoreRejected",
    "StoreTimeout",
    "StoreUnavailable",
    "Unsupported",
    "ValueTooLarge",
    "__version__",
    "connect",
    "derive_namespace",
]
