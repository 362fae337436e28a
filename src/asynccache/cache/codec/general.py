"""The general decode: every case `Codec.decode()`'s hot paths leave to it (large values,
compressed, signed ones of any size, pickle-free, manifests, and every damaged value),
with its checks in the order docs/formats.md lists. Not hot: one call per such value.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any

from xxhash import xxh3_64_intdigest

from ..._interrupts import raised_in_signal_handler
from ...errors import DecodeError, FormatMismatch, SignatureError
from .compression import BITS_KIND, decompress
from .format import (
    COMP_MASK,
    F_MAC,
    F_MANIFEST,
    F_NOCHECK,
    F_OOB,
    F_PLAIN,
    FIXED,
    FLAG_SEEDS,
    FORGED,
    MAGIC,
    MISMATCH,
    VERSION,
    XXH_TAG,
    check_flags,
)
from .mac import Signer, mac_prefix
from .manifest import decode_manifest
from .pickling import split_oob, unpickle_error

__all__ = ["DecodeRules", "decode_general", "plain_module"]

#: decode copies payloads up to this size instead of making a memoryview
SLICE_MAX = 2048


@dataclass(frozen=True)
class DecodeRules:
    """What a `Codec` checks values against, fixed by its configuration (decode never
    reads the tag's length nor the MAC algorithm from the stored bytes)."""

    signer: Signer | None
    #: the flags bytes accepted without looking further (`format.accepted_flags`)
    accepted: frozenset[int]
    checksum: bool
    allow_pickle: bool
    max_value_bytes: int
    #: length of the tag after the 4 fixed header bytes
    tag_size: int


_codec_plain: Any = None


def plain_module() -> Any:
    """`asynccache.cache.codec.plain`, imported on first use (msgpack costs ~5 ms to import).

    ImportError escapes: Codec(allow_pickle=False) turns it into MissingDependency, decode
    into a DecodeError.
    """
    global _codec_plain
    if _codec_plain is None:
        from . import plain as codec_plain

        _codec_plain = codec_plain
    return _codec_plain


def _unverified(rules: DecodeRules, message: str) -> DecodeError:
    """The error for bytes rejected before their tag was checked: with a secret, a
    SignatureError (whoever wrote them did not hold it)."""
    return DecodeError(message) if rules.signer is None else SignatureError(message)


def decode_general(rules: DecodeRules, data: bytes | bytearray | memoryview, key: bytes,
               owned: bool = False) -> object:
    """Every case but `Codec.decode()`'s hot paths; checks run in the order
    docs/formats.md lists."""
    try:
        magic, version, flags = FIXED.unpack_from(data)
    except struct.error as exc:
        raise _unverified(
            rules,
            f"not an asynccache value: {_describe(data)} is shorter than the header"
        ) from exc
    except (TypeError, ValueError, BufferError) as exc:
        raise DecodeError(
            f"not an asynccache value: cannot read a {type(data).__name__} as bytes"
        ) from exc
    if magic != MAGIC:
        raise _unverified(
            rules,
            f"not an asynccache value (starts with {FIXED.pack(magic, version, flags)!r}): "
            "the key holds foreign data"
        )
    if version != VERSION:
        raise FormatMismatch(
            f"value is in asynccache format version {version}, this asynccache reads "
            f"version {VERSION} (written by a different asynccache release)"
        )
    view: Any
    if type(data) is bytes:
        size = len(data)
        view = data if size <= SLICE_MAX else memoryview(data)  # never copy a large one
    else:
        view = _byte_view(data)
        size = len(view)
    if size > rules.max_value_bytes:
        raise DecodeError(f"value is {size} bytes, over max_value_bytes={rules.max_value_bytes}")
    start = FIXED.size + rules.tag_size
    payload = view[start:]
    signer = rules.signer
    if signer is not None:  # verify first: nothing of a forgery is looked at
        if not flags & F_MAC:
            raise SignatureError(
                "value is not signed: written by a Codec without a secret, or forged"
            )
        prefix = mac_prefix(key, bytes(view[: FIXED.size]))
        if size < start or not signer.verify([prefix, payload], view[FIXED.size : start]):
            raise SignatureError(FORGED)
        if flags not in rules.accepted:
            check_flags(flags, rules.checksum, rules.allow_pickle)
    else:
        if flags & F_MAC:
            raise DecodeError(
                "value is signed: written by a Codec with a secret (Codec(secret=...) or "
                "Codec.from_env()); this Codec has none, so it cannot verify it"
            )
        if flags not in rules.accepted:
            check_flags(flags, rules.checksum, rules.allow_pickle)
        key_seed = xxh3_64_intdigest(key, FLAG_SEEDS[flags])
        tag = key_seed if flags & F_NOCHECK else xxh3_64_intdigest(payload, key_seed)
        if view[FIXED.size : start] != XXH_TAG.pack(tag):
            raise DecodeError(MISMATCH)
    # Out-of-band buffers as views of data: only memory of this value's own, as
    # received (a decompressed payload is a fresh immutable bytes).
    owned_at = start if owned and type(view) is memoryview and not view.readonly else None
    if flags & COMP_MASK:
        owned_at = None
        kind = BITS_KIND[flags & COMP_MASK]
        payload = memoryview(decompress(kind, payload, rules.max_value_bytes - start))
    if flags & F_MANIFEST:
        return decode_manifest(payload, rules.max_value_bytes)
    if flags & F_PLAIN:
        try:
            plain = plain_module()
        except ImportError as exc:
            raise DecodeError(
                "value is pickle-free but msgpack is not installed: pip install msgpack"
            ) from exc
        if flags & F_OOB:
            return plain.loads(*split_oob(payload, owned_at))
        return plain.loads(payload)
    try:
        if flags & F_OOB:
            stream, buffers = split_oob(payload, owned_at)
            return pickle.loads(stream, buffers=buffers)
        return pickle.loads(payload)
    except DecodeError:
        raise
    except Exception as exc:  # UnpicklingError, EOFError, ImportError, ...
        if raised_in_signal_handler(exc):
            raise  # an interrupt, not damage: the caller's, unchanged
        raise unpickle_error(exc) from exc


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        try:
            mv = mv.cast("B")
        except TypeError as exc:
            raise DecodeError(f"cannot read a {mv.format!r} memoryview as bytes") from exc
    return mv


def _describe(data: object) -> str:
    try:
        return f"{len(memoryview(data))}-byte input"  # type: ignore[arg-type]
    except TypeError:
        return f"a {type(data).__name__}"
