"""Values larger than the store takes in one item: written as chunks under keys of their
own and, last, a manifest under the value's key; read back by reading every chunk in one
request and joining them (a chunk missing or damaged: the whole value is a miss). The
manifest's format is the codec's; the chunk keys are the key scheme's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import DecodeError, ValueTooLarge
from .codec import ChunkManifest, Codec, join_chunks, split_chunks
from .keys import chunk_keys
from .markers import MISSING, NOT_READ

if TYPE_CHECKING:
    from .reads import ReadPath

__all__ = ["assemble", "chunk_keys_of", "keys_of", "resolve", "split_entries"]


def keys_of(store_key: bytes, manifest: ChunkManifest) -> list[bytes]:
    """The keys of the chunks of the value under ``store_key``."""
    return chunk_keys(store_key, manifest.token, manifest.chunks)


def split_entries(blobs: Mapping[bytes, bytes], limit: int | None, codec: Codec,
                  chunking: bool = True) -> tuple[dict[bytes, bytes], int]:
    """Store-ready entries for encoded values, and how many values were chunked: a value
    over ``limit`` becomes its chunks and, last, a manifest under its own key (a writer
    that writes entries in order has written every chunk when the manifest lands).
    ``ValueTooLarge`` when ``chunking`` is off."""
    if limit is None or all(len(b) <= limit for b in blobs.values()):
        return dict(blobs), 0
    entries: dict[bytes, bytes] = {}
    chunked = 0
    for store_key, blob in blobs.items():
        if len(blob) <= limit:
            entries[store_key] = blob
            continue
        if not chunking:
            raise ValueTooLarge(
                f"value for {store_key!r} is {len(blob)} bytes, over the store's limit of "
                f"{limit}; enable chunking=True or raise the server's item size"
            )
        chunk_size = max(limit - 64, 1024)
        manifest = ChunkManifest.for_blob(blob, chunk_size)
        parts = split_chunks(blob, chunk_size)
        for chunk_key, part in zip(keys_of(store_key, manifest), parts):
            entries[chunk_key] = bytes(part)
        entries[store_key] = codec.encode_manifest(manifest, store_key)
        chunked += 1
    return entries, chunked


def chunk_keys_of(store_keys: Sequence[bytes], manifests: Mapping[int, ChunkManifest]
                  ) -> list[bytes]:
    """Every chunk key of the values ``manifests`` describe (positions in ``store_keys``),
    in the order `assemble` takes their blobs: one request reads them all."""
    return [k for i, m in manifests.items() for k in keys_of(store_keys[i], m)]


async def resolve(reads: ReadPath, store_keys: Sequence[bytes],
                  manifests: dict[int, ChunkManifest], out: list[Any],
                  second_look: bool = False) -> None:
    """Replace ``out[i]`` by the joined value of each manifest (one request for all
    chunks; a missing or damaged chunk leaves the miss in place)."""
    blobs, _error = await reads.blobs(chunk_keys_of(store_keys, manifests))
    assemble(reads, store_keys, manifests, out, blobs, second_look)


def assemble(reads: ReadPath, store_keys: Sequence[bytes],
             manifests: Mapping[int, ChunkManifest], out: list[Any], blobs: Sequence[Any],
             second_look: bool = False) -> None:
    """`resolve` once the chunks were read (``blobs``, in `chunk_keys_of`'s order), by
    whichever path read them: no I/O."""
    cache = reads.cache
    pos = 0
    for i, manifest in manifests.items():
        parts = blobs[pos : pos + manifest.chunks]
        pos += manifest.chunks
        if any(p is None or p is NOT_READ for p in parts):
            continue  # a chunk was evicted (or not read): the whole value is a miss
        keep = cache.l1 is not None  # the L1 tier keeps the bytes: decode a copy
        try:
            joined = join_chunks(parts, manifests[i], owned=not keep)
            out[i] = cache.codec.decode(joined, store_keys[i], owned=not keep)
        except DecodeError as exc:
            out[i] = MISSING if second_look else reads.decode_failed(store_keys[i], exc)
            continue
        if cache.l1 is not None:
            cache.l1.put(store_keys[i], bytes(joined))
