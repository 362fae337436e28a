"""Values to bytes and back (`Codec`), one concern a module: the header and flags (format),
pickling with out-of-band buffers, the pickle-free format (plain), compression, signing
(mac), chunk manifests. The format: docs/formats.md.
"""

from .codec import DEFAULT_CODEC, Codec
from .format import HEADER_SIZE
from .manifest import MAX_MANIFEST_BLOB, ChunkManifest, join_chunks, split_chunks

__all__ = ["DEFAULT_CODEC", "HEADER_SIZE", "MAX_MANIFEST_BLOB", "ChunkManifest", "Codec",
           "join_chunks", "split_chunks"]
