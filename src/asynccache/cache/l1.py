"""The L1 tier: a bounded, in-process LRU of *encoded* values in front of the store.

For items reused within one process — several crops of one image, a validation set read
every epoch — a hit in L1 skips the network. It holds the bytes, not the objects: every
hit is decoded afresh (one copy for arrays and tensors), so a consumer that changes a
sample in place (``img.mul_(…)``) can never change what the next reader gets.
Bounded in bytes; the least recently used entries go first. Thread-safe (one lock,
taken for a dict move per lookup).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

__all__ = ["L1Cache"]

#: What one entry costs beyond its value and key (the dict slot and the bytes headers).
_ENTRY_OVERHEAD = 100


class L1Cache:
    """``store key → encoded value``, at most ``max_bytes`` of them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._data: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            blob = self._data.get(key)
            if blob is not None:
                self._data.move_to_end(key)
            return blob

    def put(self, key: bytes, blob: bytes) -> None:
        cost = len(blob) + len(key) + _ENTRY_OVERHEAD
        if cost > self.max_bytes:
            return  # larger than the whole tier: it would only evict everything else
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.size -= len(old) + len(key) + _ENTRY_OVERHEAD
            self._data[key] = blob
            self.size += cost
            while self.size > self.max_bytes:
                evicted_key, evicted = self._data.popitem(last=False)
                self.size -= len(evicted) + len(evicted_key) + _ENTRY_OVERHEAD

    def discard(self, keys: Iterable[bytes]) -> None:
        """Drop ``keys`` (an invalidation: the next read goes to the store)."""
        with self._lock:
            for key in keys:
                old = self._data.pop(key, None)
                if old is not None:
                    self.size -= len(old) + len(key) + _ENTRY_OVERHEAD

    def __len__(self) -> int:
        return len(self._data)
