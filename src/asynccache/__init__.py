"""asynccache: an async key-value cache client with batched prefetching.

A shared remote store (Redis/Valkey, memcached, Redis Cluster) in place of the per-worker
dict cache of PyTorch pipelines, without a network round trip per item:

```python
import asynccache as ac

client = ac.connect("redis://127.0.0.1:6379/0")
dp = SequenceWrapper(items).map(expensive).async_kv_cache(client, prefetch=64)

async with ac.AsyncKVCache(client, namespace="svc-v1") as cache:
    hits = await cache.get_many(["a", "b"])
```

``import asynccache`` imports neither torch nor numpy. ``async_kv_cache`` is on
``torch.utils.data.MapDataPipe`` whenever both packages are imported, in either order;
``AsyncKVCacheMapDataPipe`` and ``asynccache.nodes`` import torch when first used.
"""

from __future__ import annotations

import logging as _logging
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._torch import register_functional as _register_functional
from ._torch import when_imported as _when_imported
from .cache.codec import Codec
from .cache.core import AsyncKVCache
from .cache.markers import MISSING
from .errors import (
    CacheError,
    ClosedError,
    ConfigError,
    DecodeError,
    EncodeError,
    FormatMismatch,
    InvalidURL,
    KeyEncodingError,
    KeyTooLong,
    LoopError,
    MethodKeyError,
    MissingDependency,
    SignatureError,
    StoreError,
    StoreRejected,
    StoreTimeout,
    StoreUnavailable,
    Unsupported,
    ValueTooLarge,
)
from .store.api import BaseClient
from .store.connect import connect
from .store.memcached.client import MemcachedClient
from .store.memory import MemoryClient
from .store.provider import Provider
from .store.redis.client import RedisClient
from .store.registry import register_scheme
from .store.tiered import Tiered

if _TYPE_CHECKING:  # loaded lazily by __getattr__ below (torch, redis-py)
    from .readahead.datapipe import AsyncKVCacheMapDataPipe as AsyncKVCacheMapDataPipe
    from .store.redis.cluster import RedisClusterClient as RedisClusterClient

__version__ = "0.1.0"

# What ``from asynccache import *`` gives. Not the two names loaded on first use
# (``AsyncKVCacheMapDataPipe`` imports torch, ``RedisClusterClient`` redis-py): a star
# import must stay as light as ``import asynccache``; both are attributes like the rest
# (``ac.AsyncKVCacheMapDataPipe``, ``from asynccache import AsyncKVCacheMapDataPipe``).
__all__ = [
    "MISSING",
    "AsyncKVCache",
    "BaseClient",
    "CacheError",
    "ClosedError",
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
    "MethodKeyError",
    "MissingDependency",
    "Provider",
    "RedisClient",
    "SignatureError",
    "StoreError",
    "StoreRejected",
    "StoreTimeout",
    "StoreUnavailable",
    "Tiered",
    "Unsupported",
    "ValueTooLarge",
    "__version__",
    "connect",
    "register_scheme",
]

# The library's logger says nothing below WARNING unless asked: its DEBUG lines ("failed
# again") stay out of an application that sets its root logger to INFO or DEBUG, until
# it lowers this level. No NullHandler on purpose: the one-time failure warnings (the
# only WARNINGs, once per kind per job) must reach stderr through logging's last-resort
# handler when the application configured no logging at all -- a cache that silently
# stopped caching is what a user must hear about. The periodic summary
# (asynccache.metrics.log_summary) logs at INFO on a child logger left at INFO: a user
# who started it wants its lines.
_logger = _logging.getLogger("asynccache")
if _logger.level == _logging.NOTSET:
    _logger.setLevel(_logging.WARNING)
_summary_logger = _logging.getLogger("asynccache.summary")
if _summary_logger.level == _logging.NOTSET:
    _summary_logger.setLevel(_logging.INFO)


def __getattr__(name: str) -> _Any:
    """The PyTorch integration, imported (with torch) when first asked for."""
    if name == "AsyncKVCacheMapDataPipe":
        from .readahead.datapipe import AsyncKVCacheMapDataPipe

        return AsyncKVCacheMapDataPipe
    if name == "RedisClusterClient":  # imports redis-py (the cluster's slot map)
        from .store.redis.cluster import RedisClusterClient

        return RedisClusterClient
    raise AttributeError(f"module 'asynccache' has no attribute {name!r}")


_when_imported("torch", _register_functional)
