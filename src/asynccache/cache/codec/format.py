"""The layout every value shares: magic, version, flags, a tag (docs/formats.md), and the
flag combinations a reader accepts."""

from __future__ import annotations

import functools
import struct

from xxhash import xxh3_64_intdigest

from ...errors import DecodeError

MAGIC = b"\xacC"
VERSION = 2
FIXED = struct.Struct("<2sBB")  # magic, version, flags: the part of the header every codec shares
XXH_TAG = struct.Struct("<Q")  # the xxh3-64 tag
HEADER_SIZE = FIXED.size + XXH_TAG.size  # 12: the header of every value this release writes

COMP_MASK = 0b0000_0011
COMP_ZSTD = 1
COMP_LZ4 = 2
F_OOB = 0b0000_0100
F_MANIFEST = 0b0000_1000
F_NOCHECK = 0b0001_0000
F_MAC = 0b0010_0000  # the tag is a keyed BLAKE3 MAC (Codec(secret=...))
F_PLAIN = 0b0100_0000  # the payload is pickle-free (asynccache.cache.codec.plain)
KNOWN_FLAGS = COMP_MASK | F_OOB | F_MANIFEST | F_NOCHECK | F_MAC | F_PLAIN

MAC_SIZE = 16  # 128-bit tags: forging one takes ~2**127 guesses, each a store round trip
SIGNED_HEADER_SIZE = FIXED.size + MAC_SIZE  # 20

# H(bytes([VERSION, flags])) for every flags byte: the seed of the key hash, so the tag
# covers version and flags without hashing a concatenation.
FLAG_SEEDS = tuple(xxh3_64_intdigest(bytes([VERSION, f])) for f in range(256))
SEED0 = FLAG_SEEDS[0]
SEED_NOCHECK = FLAG_SEEDS[F_NOCHECK]
SEED_OOB = FLAG_SEEDS[F_OOB]
HOT = struct.Struct("<4sQ")  # fixed header + xxh3 tag, read and written in one call
PREFIX0 = FIXED.pack(MAGIC, VERSION, 0)
PREFIX_NOCHECK = FIXED.pack(MAGIC, VERSION, F_NOCHECK)

MISMATCH = "checksum mismatch: damaged, truncated, or written under another key"
FORGED = (
    "signature mismatch: signed by none of this Codec's secrets (forged, damaged, truncated, "
    "signed with another secret, or written under another key)"
)


def check_flags(flags: int, checksum: bool, allow_pickle: bool) -> None:
    """Refuse flag combinations this release never writes, or a Codec so configured never
    reads (`accepted_flags()` tabulates it: decode calls it only to raise)."""
    if flags & ~KNOWN_FLAGS or flags & COMP_MASK == COMP_MASK:
        raise DecodeError(f"unknown flags 0x{flags:02x} (written by a newer asynccache?)")
    if flags & F_MANIFEST and flags & (F_OOB | COMP_MASK | F_PLAIN):
        raise DecodeError(f"invalid flags 0x{flags:02x} for a chunk manifest")
    if flags & F_NOCHECK and flags & F_MAC:
        raise DecodeError(f"invalid flags 0x{flags:02x}: a signed value is always checked")
    if flags & F_NOCHECK and checksum:
        raise DecodeError(
            "value was written without a checksum (Codec(checksum=False)); this Codec has "
            "checksum=True and never accepts an unverified payload"
        )
    if not allow_pickle and not flags & (F_PLAIN | F_MANIFEST):
        raise DecodeError(
            "value is pickled (written by a Codec with allow_pickle=True); this Codec has "
            "allow_pickle=False and never unpickles"
        )


@functools.cache
def accepted_flags(checksum: bool, allow_pickle: bool) -> frozenset[int]:
    """The flags bytes `check_flags()` accepts: one set lookup per decode."""
    accepted = set()
    for flags in range(256):
        try:
            check_flags(flags, checksum, allow_pickle)
        except DecodeError:
            continue
        accepted.add(flags)
    return frozenset(accepted)
