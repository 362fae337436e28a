"""The parts one cache is made of, frozen together: what its mechanisms (reads, writes,
leases, the decorator, a pipe's consumer threads) take instead of the cache itself.

`AsyncKVCache` builds them once; each mechanism reads what it needs from here and nothing
from the cache, so none of them imports the cache (no circle), and a mechanism's inputs
are named in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..observe.histogram import Histograms
from ..observe.stats import Counters
from ..store.api import BaseClient
from .codec import Codec
from .health import FailurePolicy
from .keys import Keyspace
from .l1 import L1Cache
from .loops import Loops
from .write_queue import WriteQueue

__all__ = ["CacheParts"]


@dataclass(frozen=True, eq=False)
class CacheParts:
    """One cache's parts. Settings are resolved (``ttl`` and ``lease`` in seconds)."""

    #: the byte store (`asynccache.connect()`)
    client: BaseClient[Any]
    #: the namespace and its key rule
    keyspace: Keyspace
    #: how values become bytes and back (any thread)
    codec: Codec
    #: seconds values live in the store (None: no expiry)
    ttl: float | None
    #: seconds of a lease (None: leases off)
    lease: float | None
    #: values over the store's item size are split into chunks
    chunking: bool
    #: the cache's counters (any thread)
    counters: Counters
    #: durations of store requests
    histograms: Histograms
    #: what a store failure does: counted, logged once, backed off, raised in raise mode
    policy: FailurePolicy
    #: the in-process tier in front of the store, if any
    l1: L1Cache | None
    #: the one write-behind queue and the record of this process's writes
    writes: WriteQueue
    #: the state held in the running event loop, and the cache's end
    loops: Loops
