"""Values larger than the store takes in one item: written as chunks under keys of their
own and, last, a manifest under the value's key; read back by reading every chunk in one
request and joining them (`ReadPath.resolve_chunks()`: a chunk missing or damaged, the
whole value is a miss). The manifest's format is the codec's; the chunk keys are the key
scheme's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import ValueTooLarge
from .codec import ChunkManifest, Codec, split_chunks
from .keys import chunk_keys

__all__ = ["chunk_keys_of", "keys_of", "split_entries"]


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
