"""The manifest of a chunked value (what the store holds under its key), and how its
chunks are cut and joined; the chunking itself is `asynccache.cache.chunks`."""

from __future__ import annotations

import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from ...errors import ConfigError, DecodeError
from .format import SIGNED_HEADER_SIZE

MANIFEST = struct.Struct("<QQQQB")
MIN_CHUNK_SIZE = 1024  # smallest chunk a manifest may name (bounds the chunk count)
#: The largest blob a chunk manifest can be (signed header, fields, a 255-byte token):
#: a stored value larger than this is never one (``asynccache warm`` relies on it).
MAX_MANIFEST_BLOB = SIGNED_HEADER_SIZE + MANIFEST.size + 255
U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class ChunkManifest:
    """What the core stores under the main key when a value is split into chunks."""

    chunks: int  # number of chunks: always ceil(size / chunk_size)
    size: int  # total byte length of the joined payload (the encode() output that was split)
    chunk_size: int  # length of every chunk but the last
    digest: int  # xxh3-64 of the joined payload
    token: str  # random id, so chunk keys of an overwritten value never mix with the old ones

    def __post_init__(self) -> None:
        for name in ("chunks", "size", "digest"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"ChunkManifest.{name} must be an int >= 0, got {value!r}")
        if type(self.chunk_size) is not int or self.chunk_size <= 0:
            raise ValueError(
                f"ChunkManifest.chunk_size must be an int > 0, got {self.chunk_size!r}"
            )
        if self.digest > U64_MAX:
            raise ValueError(f"ChunkManifest.digest must fit in 64 bits, got {self.digest!r}")
        expected = -(-self.size // self.chunk_size)
        if self.chunks != expected:
            raise ValueError(
                f"ChunkManifest.chunks is {self.chunks}, but {self.size} bytes in chunks of "
                f"{self.chunk_size} make {expected}"
            )
        if not isinstance(self.token, str) or not 0 < len(self.token.encode()) <= 255:
            raise ValueError(
                f"ChunkManifest.token must be a non-empty str of at most 255 UTF-8 bytes, "
                f"got {self.token!r}"
            )

    @classmethod
    def for_blob(cls, blob: bytes | bytearray | memoryview, chunk_size: int) -> ChunkManifest:
        """The manifest for ``split_chunks(blob, chunk_size)``, with a fresh random token."""
        check_chunk_size(chunk_size)
        size = memoryview(blob).nbytes
        return cls(
            chunks=-(-size // chunk_size),
            size=size,
            chunk_size=chunk_size,
            digest=xxh3_64_intdigest(blob),
            token=secrets.token_hex(8),
        )


def check_chunk_size(chunk_size: int) -> None:
    if type(chunk_size) is not int or chunk_size <= 0:
        raise ConfigError(f"chunk_size must be a positive int, got {chunk_size!r}")


def split_chunks(blob: bytes | bytearray | memoryview, chunk_size: int) -> list[memoryview | bytes]:
    """Zero-copy slices of ``blob``, each at most ``chunk_size`` bytes (none for b"")."""
    check_chunk_size(chunk_size)
    mv = memoryview(blob).cast("B")
    return [mv[i : i + chunk_size] for i in range(0, len(mv), chunk_size)]


def join_chunks(parts: Sequence[bytes | bytearray | memoryview], manifest: ChunkManifest,
                owned: bool = False) -> bytes | bytearray:
    """Reassemble chunks; any missing, stale or damaged chunk raises DecodeError.

    Count and total length are checked before joining, so nothing is allocated for a set
    of parts that cannot be the value. ``owned``: the value as a ``bytearray`` of its own
    (the caller decodes it in place, ``Codec.decode(owned=True)``), else ``bytes``.
    """
    if len(parts) != manifest.chunks:
        raise DecodeError(f"chunked value has {len(parts)} chunks, manifest says {manifest.chunks}")
    total = sum(memoryview(p).nbytes for p in parts)
    if total != manifest.size:
        raise DecodeError(f"chunked value is {total} bytes, manifest says {manifest.size}")
    blob = bytearray().join(parts) if owned else b"".join(parts)
    if xxh3_64_intdigest(blob) != manifest.digest:
        raise DecodeError("chunked value does not match its manifest checksum (stale or damaged)")
    return blob


def decode_manifest(payload: bytes | memoryview, max_value_bytes: int) -> ChunkManifest:
    """Parse and bound a manifest: nothing is allocated nor requested for a forged one."""
    if len(payload) < MANIFEST.size:
        raise DecodeError("truncated chunk manifest")
    chunks, size, chunk_size, digest, token_len = MANIFEST.unpack_from(payload)
    if len(payload) != MANIFEST.size + token_len:
        raise DecodeError("chunk manifest has the wrong length (truncated or damaged)")
    if size > max_value_bytes:
        raise DecodeError(
            f"chunk manifest claims a {size}-byte value, over max_value_bytes={max_value_bytes}"
        )
    if chunk_size < MIN_CHUNK_SIZE:
        raise DecodeError(
            f"chunk manifest claims {chunk_size}-byte chunks, under MIN_CHUNK_SIZE={MIN_CHUNK_SIZE}"
        )
    try:
        return ChunkManifest(
            chunks, size, chunk_size, digest, str(payload[MANIFEST.size :], "utf-8")
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"invalid chunk manifest: {exc}") from exc
