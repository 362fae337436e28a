"""Compression of a whole payload (zstd, lz4), bounded on decompression: the frame's
recorded size is checked before anything is allocated."""

from __future__ import annotations

from typing import Any

from ...errors import DecodeError, MissingDependency
from .format import COMP_LZ4, COMP_ZSTD

COMPRESSIONS = (None, "zstd", "lz4", "auto")
PACKAGES = {"zstd": "zstandard", "lz4": "lz4"}
KIND_BITS = {"zstd": COMP_ZSTD, "lz4": COMP_LZ4}
BITS_KIND = {COMP_ZSTD: "zstd", COMP_LZ4: "lz4"}


def import_backend(kind: str) -> Any:
    """Import the compression module lazily: it is optional and costs import time."""
    if kind == "zstd":
        import zstandard

        return zstandard
    import lz4.frame

    return lz4.frame


def compress(kind: str, data: bytes, level: int | None) -> bytes:
    """One frame that records its content size (both libraries' default), which decode needs."""
    mod = import_backend(kind)
    if kind == "zstd":
        return mod.compress(data, 3 if level is None else level)
    return mod.compress(data, compression_level=0 if level is None else level)


def decompress(kind: str, data: bytes | memoryview, limit: int) -> bytes:
    """Decompress one frame into at most ``limit`` bytes, allocating no more than that.

    Both libraries size their output buffer from the frame's recorded content size (zstd
    even ignores ``max_output_size`` when one is recorded), so that size is read and
    bounded first; a frame that records none is refused (asynccache never writes one), and
    one that holds more than it records fails inside the library at the recorded size.
    Peak memory is the recorded size (zstd) or twice it (python-lz4 copies its buffer into
    the returned bytes).
    """
    try:
        mod = import_backend(kind)
    except ImportError as exc:
        raise DecodeError(
            f"value is {kind}-compressed but {PACKAGES[kind]} is not installed: "
            f"pip install {PACKAGES[kind]}"
        ) from exc
    try:
        if kind == "zstd":
            size = mod.frame_content_size(data)  # -1 when not recorded
        else:
            size = mod.get_frame_info(data)["content_size"] or -1  # 0 when not recorded
    except Exception as exc:
        raise DecodeError(f"corrupt {kind}-compressed value: {exc}") from exc
    if size < 0:
        raise DecodeError(
            f"{kind} frame does not record its decompressed size (not written by asynccache)"
        )
    if size > limit:
        raise DecodeError(
            f"{kind}-compressed value expands to {size} bytes, over the {limit} bytes "
            "max_value_bytes leaves for a payload; raise max_value_bytes in Codec(...)"
        )
    try:
        if kind == "zstd":
            out = mod.ZstdDecompressor().decompress(data, allow_extra_data=False)
        else:
            # The low-level call reads ``data`` in place (LZ4FrameDecompressor copies it);
            # max_length sizes its one buffer, +1 so a frame longer than it records shows.
            ctx = mod.create_decompression_context()
            out, used, end = mod.decompress_chunk(ctx, data, max_length=size + 1)
            if not end or used != len(data):
                raise DecodeError(
                    "corrupt lz4-compressed value: frame truncated, longer than it records, "
                    "or followed by extra bytes"
                )
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"corrupt {kind}-compressed value: {exc}") from exc
    if len(out) != size:
        raise DecodeError(
            f"corrupt {kind}-compressed value: {len(out)} bytes, the frame records {size}"
        )
    return out


def resolve_compression(compression: str | None) -> str | None:
    """Map the user's setting to the backend actually used ("auto" picks what is installed)."""
    if compression is None:
        return None
    if compression == "auto":
        for kind in ("zstd", "lz4"):
            try:
                import_backend(kind)
            except ImportError:
                continue
            return kind
        return None
    try:
        import_backend(compression)
    except ImportError as exc:
        pkg = PACKAGES[compression]
        raise MissingDependency(
            f"compression={compression!r} needs the {pkg} package: pip install {pkg}"
        ) from exc
    return compression
