"""Values to bytes and back: see :class:`~asynccache.cache.codec.codec.Codec`."""

from .codec import (
    DEFAULT_CODEC,
    HEADER_SIZE,
    MAX_MANIFEST_BLOB,
    ChunkManifest,
    Codec,
    join_chunks,
    split_chunks,
)

__all__ = ["DEFAULT_CODEC", "HEADER_SIZE", "MAX_MANIFEST_BLOB", "ChunkManifest", "Codec",
           "join_chunks", "split_chunks"]
