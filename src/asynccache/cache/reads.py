"""The read path of a cache: store bytes to values, with every failure reported to the
failure policy, the L1 tier asked first, and chunked values joined.

What a read hands back is a value per key, or a marker (`asynccache.cache.markers`):
``MISSING`` (absent or unusable), ``NOT_READ`` (its node failed or backs off), `Failed`
(raise mode: undecodable). Any thread may decode; only `ReadPath.blobs()` and
`ReadPath.values()` need the cache's loop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import DecodeError, FormatMismatch, StoreError
from ..store.api import READ_TTL, STORE_COUNTS
from . import chunks
from .codec import ChunkManifest, join_chunks
from .markers import MISSING, NOT_READ, Failed

if TYPE_CHECKING:
    from .parts import CacheParts

__all__ = ["IMMUTABLE", "ReadPath"]

#: Values no reader can change in place: handed to every reader as they are.
IMMUTABLE = frozenset({bool, int, float, complex, str, bytes, type(None)})


class ReadPath:
    """Reads of one cache, from its parts."""

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    async def blobs(self, store_keys: Sequence[bytes]) -> tuple[list[Any], StoreError | None]:
        """Raw values for ``store_keys`` (``None`` absent, ``NOT_READ`` not read) and the
        first store failure, already counted and logged. Never raises for the store."""
        parts = self.parts
        policy = parts.policy
        started = time.perf_counter_ns()
        async with parts.loops.here().in_flight:
            sent = time.perf_counter_ns()
            counts = STORE_COUNTS.set(parts.counters.add)  # the store's own counts: ours
            ttl = READ_TTL.set(parts.ttl)  # copies a store keeps expire as our values do
            try:
                result = await parts.client.read(store_keys, policy.down())
            finally:
                READ_TTL.reset(ttl)
                STORE_COUNTS.reset(counts)
        done = time.perf_counter_ns()
        if result.answered or result.failures:  # a request left (not every node skipped)
            parts.histograms.record("read", done - sent)
        counters = parts.counters.shard()
        counters["batches"] += 1
        counters["keys_requested"] += len(store_keys)
        counters["batch_time_us"] += (done - started) // 1000
        for node in result.answered:
            policy.succeeded(node)
        if result.skipped:
            policy.skipped(result.skipped)
        error = None
        for node, exc in result.failures.items():
            policy.failed(node, "get", exc)
            error = error or exc
        return result.values, error

    def decode(self, store_keys: Sequence[bytes], blobs: Sequence[Any],
               reread: bool = False, owned: bool = False
               ) -> tuple[list[Any], dict[int, ChunkManifest], int, int]:
        """Decode one multi-get reply: a value per key (``MISSING`` for absent or unusable
        bytes, ``NOT_READ`` passed through, `Failed` in raise mode), the chunk manifests
        still to resolve, the bytes the reply carried and its largest value's (what
        read-ahead sizes its window by: the mean, and the largest for the memory
        budget). No I/O: any thread may call it. ``reread``: keys this process
        read a moment ago (see `Leases.claim()`); bytes that fail to decode were counted and
        logged then, and are a plain ``MISSING`` now. ``owned``: blobs that are not
        ``bytes`` are memory of their own (`ConsumerConnection.owns_buffers`), decoded
        without a copy: the values may be views of them."""
        parts = self.parts
        out: list[Any] = [MISSING] * len(blobs)
        manifests: dict[int, ChunkManifest] = {}
        codec = parts.codec
        decode = codec.decode
        l1 = parts.l1
        nbytes = largest = 0
        positions: Sequence[int] = range(len(blobs))
        decode_hot = getattr(codec, "decode_hot", None)  # a codec of the user's: no
        if l1 is None and decode_hot is not None:  # small values in one call; the rest
            positions, nbytes, largest = decode_hot(blobs, store_keys, out)  # one by one
        seen: set[int] | None = None  # owned buffers decoded in place so far
        for i in positions:
            blob = blobs[i]
            if blob is None:
                continue
            if blob is NOT_READ:
                out[i] = NOT_READ
                continue
            size = len(blob)
            nbytes += size
            if size > largest:
                largest = size
            mine = owned and type(blob) is not bytes
            if mine:
                if l1 is not None:  # the L1 tier keeps these bytes: the value gets a copy
                    blob = bytes(blob)
                    mine = False
                elif len(blobs) > 1:  # one buffer at two positions (a key asked twice):
                    if seen is None:  # the second decodes from it before anyone changes
                        seen = set()  # the first, as a copy
                    mine = id(blob) not in seen
                    seen.add(id(blob))
            try:
                value = decode(blob, store_keys[i], mine)
            except DecodeError as exc:
                out[i] = MISSING if reread else self.decode_failed(store_keys[i], exc)
                continue
            if type(value) is ChunkManifest:
                manifests[i] = value  # MISSING until its chunks are read
            else:
                out[i] = value
                if l1 is not None:
                    l1.put(store_keys[i], bytes(blob))  # bytes: no copy
        parts.counters.shard()["bytes_read"] += nbytes
        return out, manifests, nbytes, largest

    def from_l1(self, store_keys: Sequence[bytes]) -> tuple[list[Any], list[int]]:
        """Values the L1 tier holds (decoded afresh, ``NOT_READ`` where it has none) and
        the positions it had nothing for. Any thread."""
        parts = self.parts
        l1 = parts.l1
        if l1 is None:
            return [NOT_READ] * len(store_keys), list(range(len(store_keys)))
        values: list[Any] = [NOT_READ] * len(store_keys)
        missing = []
        decode = parts.codec.decode
        for i, key in enumerate(store_keys):
            blob = l1.get(key)
            if blob is None:
                missing.append(i)
                continue
            try:
                values[i] = decode(blob, key)
            except DecodeError:  # cannot happen for bytes we decoded before; be safe
                missing.append(i)
        hits = len(store_keys) - len(missing)
        if hits:
            parts.counters.shard()["l1_hits"] += hits
        return values, missing

    def decode_failed(self, store_key: bytes, exc: DecodeError) -> Any:
        """Count and log undecodable bytes: ``MISSING``, or `Failed` in raise mode."""
        policy = self.parts.policy
        error = type(exc)(f"key {store_key!r}: {exc}")
        policy.decode_failed(error)
        if policy.strict and not isinstance(exc, FormatMismatch):
            return Failed(error)
        return MISSING

    async def values(self, store_keys: Sequence[bytes],
                     sizes: list[tuple[int, int]] | None = None,
                     reread: bool = False) -> tuple[list[Any], StoreError | None]:
        """Decoded values (or markers) and the first store failure: the whole read path
        of the loop thread; never raises for the store. Keys the L1 tier holds are not
        asked for. ``sizes`` gets the bytes the store's reply carried and its largest
        value's appended (read-ahead sizes its requests by them). ``reread``: see
        `decode()`."""
        if self.parts.l1 is not None:
            values, missing = self.from_l1(store_keys)
            if not missing:
                return values, None
            if len(missing) < len(store_keys):
                asked = [store_keys[i] for i in missing]
                found, error = await self.from_store(asked, sizes, reread)
                for i, value in zip(missing, found):
                    values[i] = value
                return values, error
        return await self.from_store(store_keys, sizes, reread)

    async def from_store(self, store_keys: Sequence[bytes],
                         sizes: list[tuple[int, int]] | None = None,
                         reread: bool = False) -> tuple[list[Any], StoreError | None]:
        blobs, error = await self.blobs(store_keys)
        values, manifests, nbytes, largest = self.decode(
            store_keys, blobs, reread, self.parts.client.reads_own_buffers)
        if sizes is not None:
            sizes.append((nbytes, largest))
        if manifests:
            await self.resolve_chunks(store_keys, manifests, values, reread)
        return values, error

    async def resolve_chunks(self, store_keys: Sequence[bytes],
                             manifests: dict[int, ChunkManifest], out: list[Any],
                             reread: bool = False) -> None:
        """Replace ``out[i]`` by the joined value of each manifest (one request for all
        chunks; a missing or damaged chunk leaves the miss in place)."""
        blobs, _error = await self.blobs(chunks.chunk_keys_of(store_keys, manifests))
        self.assemble(store_keys, manifests, out, blobs, reread)

    def assemble(self, store_keys: Sequence[bytes], manifests: Mapping[int, ChunkManifest],
                 out: list[Any], blobs: Sequence[Any], reread: bool = False) -> None:
        """`resolve_chunks` once the chunks were read (``blobs``, in
        `chunks.chunk_keys_of`'s order), by whichever path read them: no I/O."""
        parts = self.parts
        l1, decode = parts.l1, parts.codec.decode
        keep = l1 is not None  # the L1 tier keeps the bytes: decode a copy
        pos = 0
        for i, manifest in manifests.items():
            pieces = blobs[pos : pos + manifest.chunks]
            pos += manifest.chunks
            if any(p is None or p is NOT_READ for p in pieces):
                continue  # a chunk was evicted (or not read): the whole value is a miss
            try:
                joined = join_chunks(pieces, manifest, owned=not keep)
                out[i] = decode(joined, store_keys[i], owned=not keep)
            except DecodeError as exc:
                out[i] = MISSING if reread else self.decode_failed(store_keys[i], exc)
                continue
            if l1 is not None:
                l1.put(store_keys[i], bytes(joined))

    async def read(self, store_keys: Sequence[bytes]) -> list[Any]:
        """What callers get for ``store_keys``: values, ``MISSING``, `Failed` (the whole
        read path and `outcomes()`)."""
        return self.outcomes(*await self.values(store_keys))

    def outcomes(self, values: list[Any], error: StoreError | None) -> list[Any]:
        """Markers → what a caller gets, counting hits and misses: ``MISSING`` for a
        miss; in raise mode `Failed` for a key whose node failed or whose bytes
        did not decode (the caller raises it)."""
        strict = self.parts.policy.strict
        hits = misses = 0
        for i, value in enumerate(values):
            if value is MISSING or value is NOT_READ:
                if strict and value is NOT_READ and error is not None:
                    values[i] = Failed(error)
                    continue
                values[i] = MISSING
                misses += 1
            elif type(value) is not Failed:
                hits += 1
        counters = self.parts.counters.shard()
        counters["hits"] += hits
        counters["misses"] += misses
        return values

    def copy_of(self, store_key: bytes, value: Any) -> Any:
        """An object of its own with ``value``'s content, as a second reader of the same
        key gets it: encoded and decoded again (only where a key repeats)."""
        if value is None or type(value) in IMMUTABLE:
            return value
        codec = self.parts.codec
        return codec.decode(codec.encode(value, store_key), store_key)
