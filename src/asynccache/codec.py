"""Object <-> bytes for the store: pickle 5, out-of-band buffers, header, compression, chunks.

Every value the core writes goes through :meth:`Codec.encode`, and every hit through
:meth:`Codec.decode`, so the common case (a small value, no arrays) is kept to one
``pickle.dumps``/``pickle.loads`` plus an 8-byte header and a crc32.

Blob layout (little endian)::

    offset  size  field
    0       2     magic   b"\\xacC"   (0xAC is a UTF-8 continuation byte, so no text, JSON
                                      or pickle (b"\\x80" / b"(") starts with it)
    2       1     format version (1)
    3       1     flags
                    bits 0-1  compression: 0 none, 1 zstd, 2 lz4 (3 is invalid)
                    bit  2    payload has out-of-band buffers (see below)
                    bit  3    payload is a chunk manifest (not user data)
                    bit  4    no checksum: the crc field must be 0
                    bits 5-7  reserved, must be 0
    4       4     crc32 of bytes [2:4] + payload (zlib.crc32), so a flipped flag or
                  version byte is caught too; 0 when bit 4 is set
    8       ...   payload (compressed as a whole when the compression bits are set)

Payload kinds (after decompression):

* plain: one pickle stream. This is the fast path: no buffer table at all.
* out-of-band (bit 2)::

      0    8        length of the pickle stream (P)
      8    4        number of buffers (N)
      12   8*N      length of each buffer
      ...  P        pickle stream (protocol 5, buffers referenced by NEXT_BUFFER)
      ...           buffer region: buffer i starts at the next multiple of 16 bytes
                    (relative to the region start; zero padding), ends the blob exactly

  The table comes before the stream so that decode knows where the stream ends without
  parsing it. On decode the buffer region is copied once into a fresh ``bytearray``
  (aligned by the allocator) and the buffers are ``memoryview`` slices of it: the
  returned numpy arrays and torch tensors are writable and own no other copy.
* manifest (bit 3): ``<QQIB`` chunks, size, crc, token length, then the token as UTF-8
  (never pickled, never compressed).

Large numpy arrays go out-of-band through numpy's own protocol-5 support. Plain CPU torch
tensors are reduced by this module (dtype, shape, raw bytes) because torch's default
pickling copies the storage through ``torch.save`` into the stream; views are stored as
their contiguous values (storage sharing between tensors in one value is not kept).
Tensors that need torch's own pickling (autograd, sparse, quantized, non-CPU) use it.

Security: decoding runs ``pickle.loads``. Point the cache only at stores you trust.
"""

from __future__ import annotations

import io
import pickle
import secrets
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asynccache.errors import ConfigError, DecodeError, EncodeError, MissingDependency

__all__ = [
    "DEFAULT_CODEC",
    "ChunkManifest",
    "Codec",
    "join_chunks",
    "split_chunks",
]

MAGIC = b"\xacC"
VERSION = 1
_PREFIX = MAGIC + bytes([VERSION])
_HEADER = struct.Struct("<3sBI")
HEADER_SIZE = _HEADER.size  # 8

_COMP_MASK = 0b0000_0011
_COMP_ZSTD = 1
_COMP_LZ4 = 2
_F_OOB = 0b0000_0100
_F_MANIFEST = 0b0000_1000
_F_NOCRC = 0b0001_0000
_KNOWN_FLAGS = _COMP_MASK | _F_OOB | _F_MANIFEST | _F_NOCRC

# crc32 of the (version, flags) header bytes, used as the running crc start value:
# crc32(payload, _SEEDS[flags]) == crc32(bytes([VERSION, flags]) + payload).
_SEEDS = tuple(zlib.crc32(bytes([VERSION, f])) for f in range(256))
_SEED0 = _SEEDS[0]

_OOB_HEAD = struct.Struct("<QI")
_ALIGN = 16  # enough for every numpy / torch dtype; the allocator gives >= 16
_ZEROS = bytes(_ALIGN)
_SLICE_MAX = 2048  # decode copies payloads up to this size instead of making a memoryview
_MANIFEST = struct.Struct("<QQIB")

# Exact types that never produce out-of-band buffers nor need the tensor reducer.
_ATOMIC = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray})

_COMPRESSIONS = (None, "zstd", "lz4", "auto")
_PACKAGES = {"zstd": "zstandard", "lz4": "lz4"}
_KIND_BITS = {"zstd": _COMP_ZSTD, "lz4": _COMP_LZ4}
_BITS_KIND = {_COMP_ZSTD: "zstd", _COMP_LZ4: "lz4"}


# --------------------------------------------------------------------------- compression


def _import_backend(kind: str) -> Any:
    """Import the compression module lazily: it is optional and costs import time."""
    if kind == "zstd":
        import zstandard

        return zstandard
    import lz4.frame

    return lz4.frame


def _compress(kind: str, data: bytes, level: int | None) -> bytes:
    mod = _import_backend(kind)
    if kind == "zstd":
        return mod.compress(data, 3 if level is None else level)
    return mod.compress(data, compression_level=0 if level is None else level)


def _decompress(kind: str, data: memoryview) -> bytes:
    try:
        mod = _import_backend(kind)
    except ImportError as exc:
        raise DecodeError(
            f"value is {kind}-compressed but {_PACKAGES[kind]} is not installed: "
            f"pip install {_PACKAGES[kind]}"
        ) from exc
    try:
        return mod.decompress(data)
    except Exception as exc:
        raise DecodeError(f"corrupt {kind}-compressed value: {exc}") from exc


def _resolve_compression(compression: str | None) -> str | None:
    """Map the user's setting to the backend actually used ("auto" picks what is installed)."""
    if compression is None:
        return None
    if compression == "auto":
        for kind in ("zstd", "lz4"):
            try:
                _import_backend(kind)
            except ImportError:
                continue
            return kind
        return None
    try:
        _import_backend(compression)
    except ImportError as exc:
        pkg = _PACKAGES[compression]
        raise MissingDependency(
            f"compression={compression!r} needs the {pkg} package: pip install {pkg}"
        ) from exc
    return compression


# --------------------------------------------------------------------------- torch tensors


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """Unpickle side of :func:`_reduce_tensor`: a tensor sharing (not copying) ``buf``."""
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise DecodeError(f"unknown torch dtype {dtype!r}")
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if mv.readonly:  # only when pickled in-band by someone else: copy, never warn
        buf = bytearray(buf)
    return torch.frombuffer(buf, dtype=torch_dtype).reshape(shape)


def _reduce_tensor(t: Any, torch: Any) -> Any:
    """Reduce a plain CPU tensor to (dtype, shape, PickleBuffer of its bytes).

    Returns NotImplemented (torch's own pickling) for anything whose meaning is more than
    its values: autograd state, subclasses, sparse/quantized/nested/non-CPU tensors.
    """
    if (
        t.requires_grad
        or t.layout is not torch.strided
        or t.device.type != "cpu"
        or t.is_quantized
        or t.is_nested
    ):
        return NotImplemented
    flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    try:
        raw = flat.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # numpy missing or an exotic dtype
        return NotImplemented
    dtype = str(t.dtype).removeprefix("torch.")
    return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype, tuple(t.shape))


class _Pickler(pickle.Pickler):
    """C pickler with two reductions plain ``pickle.dumps`` cannot do.

    * plain CPU torch tensors go out-of-band (see :func:`_reduce_tensor`);
    * read-only numpy arrays are pickled from a writable copy: pickle marks a read-only
      buffer READONLY_BUFFER and decode would then return a read-only array, which
      torch (``as_tensor``/``from_numpy``, hence ``default_collate``) warns about.
    """

    def __init__(self, protocol: int) -> None:
        self.file = io.BytesIO()
        self.buffers: list[pickle.PickleBuffer] = []
        super().__init__(self.file, protocol, buffer_callback=self.buffers.append)
        self.protocol = protocol
        self.torch: Any = None
        self.tensor_type: Any = None
        self.ndarray_type: Any = None

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is self.tensor_type:
            return _reduce_tensor(obj, self.torch)
        if cls is self.ndarray_type and not obj.flags.writeable:
            return obj.copy(order="K").__reduce_ex__(self.protocol)
        return NotImplemented


_local = threading.local()


def _dumps_special(obj: object, protocol: int) -> tuple[bytes, list[Any]]:
    """pickle.dumps through :class:`_Pickler`, reusing one pickler per thread.

    Building a pickler + BytesIO costs ~1 µs, more than pickling a small value. The
    pickler is taken out of the thread-local while in use, so a re-entrant call (a
    ``__reduce__`` that encodes) gets its own, and one that failed mid-dump is dropped.
    """
    p: _Pickler | None = _local.__dict__.pop("pickler", None)
    if p is None or p.protocol != protocol:
        p = _Pickler(protocol)
    torch = sys.modules.get("torch")
    if p.torch is not torch or p.ndarray_type is None:  # a module was imported since
        p.torch = torch
        p.tensor_type = getattr(torch, "Tensor", None)
        p.ndarray_type = getattr(sys.modules.get("numpy"), "ndarray", None)
    p.clear_memo()  # cheap insurance: a stream must never refer to a previous dump's memo
    p.dump(obj)
    f = p.file
    stream = f.getvalue()
    f.seek(0)
    f.truncate()
    bufs: list[Any] = []
    if p.buffers:
        bufs = p.buffers.copy()
        p.buffers.clear()
    p.clear_memo()
    _local.pickler = p
    return stream, bufs


# --------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class ChunkManifest:
    """What the core stores under the main key when a value is split into chunks."""

    chunks: int  # number of chunks
    size: int  # total byte length of the joined payload (the encode() output that was split)
    crc: int  # zlib.crc32 of the joined payload
    token: str  # random id, so chunk keys of an overwritten value never mix with the old ones

    def __post_init__(self) -> None:
        for name in ("chunks", "size", "crc"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"ChunkManifest.{name} must be an int >= 0, got {value!r}")
        if self.crc > 0xFFFFFFFF:
            raise ValueError(f"ChunkManifest.crc must fit in 32 bits, got {self.crc!r}")
        if not isinstance(self.token, str) or not 0 < len(self.token.encode()) <= 255:
            raise ValueError(
                f"ChunkManifest.token must be a non-empty str of at most 255 UTF-8 bytes, "
                f"got {self.token!r}"
            )

    @classmethod
    def for_blob(cls, blob: bytes | bytearray | memoryview, chunk_size: int) -> ChunkManifest:
        """The manifest for ``split_chunks(blob, chunk_size)``, with a fresh random token."""
        _check_chunk_size(chunk_size)
        size = memoryview(blob).nbytes
        return cls(
            chunks=-(-size // chunk_size),
            size=size,
            crc=zlib.crc32(blob),
            token=secrets.token_hex(8),
        )


def _check_chunk_size(chunk_size: int) -> None:
    if type(chunk_size) is not int or chunk_size <= 0:
        raise ConfigError(f"chunk_size must be a positive int, got {chunk_size!r}")


def split_chunks(blob: bytes | bytearray | memoryview, chunk_size: int) -> list[memoryview | bytes]:
    """Zero-copy slices of ``blob``, each at most ``chunk_size`` bytes (none for b"")."""
    _check_chunk_size(chunk_size)
    mv = memoryview(blob).cast("B")
    return [mv[i : i + chunk_size] for i in range(0, len(mv), chunk_size)]


def join_chunks(parts: Sequence[bytes | bytearray | memoryview], manifest: ChunkManifest) -> bytes:
    """Reassemble chunks; any missing, stale or damaged chunk raises DecodeError."""
    if len(parts) != manifest.chunks:
        raise DecodeError(f"chunked value has {len(parts)} chunks, manifest says {manifest.chunks}")
    blob = b"".join(parts)
    if len(blob) != manifest.size:
        raise DecodeError(f"chunked value is {len(blob)} bytes, manifest says {manifest.size}")
    if zlib.crc32(blob) != manifest.crc:
        raise DecodeError("chunked value does not match its manifest checksum (stale or damaged)")
    return blob


def _decode_manifest(payload: memoryview) -> ChunkManifest:
    if len(payload) < _MANIFEST.size:
        raise DecodeError("truncated chunk manifest")
    chunks, size, crc, token_len = _MANIFEST.unpack_from(payload)
    if len(payload) != _MANIFEST.size + token_len:
        raise DecodeError("chunk manifest has the wrong length (truncated or damaged)")
    try:
        return ChunkManifest(chunks, size, crc, str(payload[_MANIFEST.size :], "utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"invalid chunk manifest: {exc}") from exc


# --------------------------------------------------------------------------- codec


def _loads_oob(payload: memoryview) -> object:
    """Parse an out-of-band payload; the buffer region is copied exactly once."""
    total = len(payload)
    if total < _OOB_HEAD.size:
        raise DecodeError("truncated buffer table")
    stream_len, nbuf = _OOB_HEAD.unpack_from(payload)
    table_end = _OOB_HEAD.size + 8 * nbuf
    region_start = table_end + stream_len
    if region_start > total:
        raise DecodeError("truncated out-of-band value")
    lengths = struct.unpack_from(f"<{nbuf}Q", payload, _OOB_HEAD.size)
    spans = []
    pos = 0
    for n in lengths:
        pos += -pos % _ALIGN
        spans.append((pos, pos + n))
        pos += n
    if pos != total - region_start:
        raise DecodeError("out-of-band buffer sizes do not match the value length")
    region = memoryview(bytearray(memoryview(payload)[region_start:]))  # the one copy
    buffers = [region[a:b] for a, b in spans]
    return pickle.loads(payload[table_end:region_start], buffers=buffers)


def _encode_error(obj: object, exc: BaseException) -> EncodeError:
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return EncodeError(
        f"cannot encode a value of type {name}: {exc}. Make it picklable "
        "(no lambdas, locks, open files or sockets; define __reduce__/__getstate__) "
        "or pass a custom codec (codec=...)."
    )


def _rebuild_codec(kwargs: dict[str, Any]) -> Codec:
    return Codec(**kwargs)


class Codec:
    """Turns cached values into self-describing blobs and back.

    Compression is applied to the whole payload only when it is at least
    ``compress_threshold`` bytes and only kept when it shrinks it; decode handles every
    compression kind regardless of this codec's setting (values written by a peer with
    another setting stay readable).
    """

    __slots__ = (
        "_kind",
        "checksum",
        "compress_level",
        "compress_threshold",
        "compression",
        "protocol",
    )

    def __init__(
        self,
        *,
        compression: str | None = None,
        compress_threshold: int = 16 * 1024,
        compress_level: int | None = None,
        checksum: bool = True,
        protocol: int = 5,
    ) -> None:
        if compression not in _COMPRESSIONS:
            raise ConfigError(
                f"compression must be one of None, 'zstd', 'lz4', 'auto'; got {compression!r}"
            )
        if type(compress_threshold) is not int or compress_threshold < 0:
            raise ConfigError(f"compress_threshold must be an int >= 0, got {compress_threshold!r}")
        if compress_level is not None and type(compress_level) is not int:
            raise ConfigError(f"compress_level must be an int or None, got {compress_level!r}")
        if type(protocol) is not int or not 0 <= protocol <= pickle.HIGHEST_PROTOCOL:
            raise ConfigError(
                f"protocol must be an int in 0..{pickle.HIGHEST_PROTOCOL}, got {protocol!r}"
            )
        self.compression = compression
        self.compress_threshold = compress_threshold
        self.compress_level = compress_level
        self.checksum = bool(checksum)
        self.protocol = protocol
        self._kind = _resolve_compression(compression)
        if self._kind is not None and compress_level is not None:
            try:  # fail now, not on the first large value
                _compress(self._kind, b"x", compress_level)
            except Exception as exc:
                raise ConfigError(
                    f"compress_level={compress_level!r} is not valid for {self._kind}: {exc}"
                ) from exc

    # -- identity -------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "compression": self.compression,
            "compress_threshold": self.compress_threshold,
            "compress_level": self.compress_level,
            "checksum": self.checksum,
            "protocol": self.protocol,
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return self._config() == other._config()

    def __hash__(self) -> int:
        return hash(tuple(self._config().values()))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"Codec({args})"

    def __reduce__(self) -> tuple[Callable[..., Codec], tuple[dict[str, Any]]]:
        # Re-run __init__ in the receiving process, so "auto" picks what is installed there.
        return _rebuild_codec, (self._config(),)

    # -- encode ---------------------------------------------------------------------------

    def _pickle(self, obj: object) -> tuple[bytes, list[pickle.PickleBuffer]]:
        if type(obj) in _ATOMIC or self.protocol < 5:
            return pickle.dumps(obj, self.protocol), []
        if "torch" in sys.modules:
            return _dumps_special(obj, self.protocol)
        bufs: list[pickle.PickleBuffer] = []
        stream = pickle.dumps(obj, self.protocol, buffer_callback=bufs.append)
        if bufs and any(memoryview(b).readonly for b in bufs):  # rare: read-only arrays
            return _dumps_special(obj, self.protocol)
        return stream, bufs

    def _finish(self, flags: int, parts: list[Any], size: int, compress: bool = True) -> bytes:
        """Compress if worthwhile, add the header, and join everything once."""
        if compress and self._kind is not None and size >= self.compress_threshold:
            packed = _compress(self._kind, b"".join(parts), self.compress_level)
            if len(packed) < size:
                parts = [packed]
                flags |= _KIND_BITS[self._kind]
        if self.checksum:
            crc = _SEEDS[flags]
            for part in parts:
                crc = zlib.crc32(part, crc)
        else:
            flags |= _F_NOCRC
            crc = 0
        return b"".join([_HEADER.pack(_PREFIX, flags, crc), *parts])

    def encode(self, obj: object, key: bytes = b"") -> bytes:  # key: placeholder until v2
        """Serialise ``obj``; EncodeError (chained) if it cannot be pickled."""
        if type(obj) is ChunkManifest:
            raise EncodeError("ChunkManifest is reserved for chunked values: use encode_manifest")
        try:
            stream, bufs = self._pickle(obj)
            if not bufs:  # fast path: header + pickle stream
                if self._kind is None or len(stream) < self.compress_threshold:
                    if self.checksum:
                        return _HEADER.pack(_PREFIX, 0, zlib.crc32(stream, _SEED0)) + stream
                    return _HEADER.pack(_PREFIX, _F_NOCRC, 0) + stream
                return self._finish(0, [stream], len(stream))
            raws = [b.raw() for b in bufs]
        except EncodeError:
            raise
        except Exception as exc:  # PicklingError, TypeError, AttributeError, BufferError, ...
            raise _encode_error(obj, exc) from exc
        lengths = [r.nbytes for r in raws]
        table = _OOB_HEAD.pack(len(stream), len(raws)) + struct.pack(f"<{len(raws)}Q", *lengths)
        parts: list[Any] = [table, stream]
        pos = 0
        for raw, n in zip(raws, lengths, strict=True):
            pad = -pos % _ALIGN
            if pad:
                parts.append(_ZEROS[:pad])
                pos += pad
            parts.append(raw)
            pos += n
        return self._finish(_F_OOB, parts, len(table) + len(stream) + pos)

    def encode_manifest(self, manifest: ChunkManifest, key: bytes = b"") -> bytes:
        """Serialise a chunk manifest (never pickled, never compressed)."""
        if not isinstance(manifest, ChunkManifest):
            raise EncodeError(f"expected a ChunkManifest, got {type(manifest).__qualname__}")
        token = manifest.token.encode("utf-8")
        payload = _MANIFEST.pack(manifest.chunks, manifest.size, manifest.crc, len(token))
        return self._finish(_F_MANIFEST, [payload, token], 0, compress=False)

    # -- decode ---------------------------------------------------------------------------

    def decode(self, data: bytes | bytearray | memoryview, key: bytes = b"") -> object:
        """Inverse of encode/encode_manifest; DecodeError for anything else or damaged."""
        try:
            prefix, flags, crc = _HEADER.unpack_from(data)
        except (struct.error, TypeError) as exc:
            raise DecodeError(
                f"not an asynccache value: {_describe(data)} is shorter than the header"
            ) from exc
        if prefix != _PREFIX:
            raise _bad_prefix(prefix)
        if not flags and type(data) is bytes and len(data) <= _SLICE_MAX:
            # Hot path (a small cached value, read from the store as bytes).
            payload = data[HEADER_SIZE:]
            if zlib.crc32(payload, _SEED0) != crc:
                raise DecodeError("damaged value: checksum mismatch (corrupt or truncated)")
            try:
                return pickle.loads(payload)
            except Exception as exc:
                raise DecodeError(f"cannot unpickle value: {type(exc).__name__}: {exc}") from exc
        if flags & ~_KNOWN_FLAGS or flags & _COMP_MASK == _COMP_MASK:
            raise DecodeError(f"unknown flags 0x{flags:02x} (written by a newer asynccache?)")
        if type(data) is bytes and len(data) <= _SLICE_MAX:
            payload: Any = data[HEADER_SIZE:]  # cheaper than a memoryview for small values
        else:
            payload = _byte_view(data)[HEADER_SIZE:]
        if flags & _F_NOCRC:
            if crc:
                raise DecodeError("damaged value: checksum flag and checksum field disagree")
        elif zlib.crc32(payload, _SEEDS[flags]) != crc:
            raise DecodeError("damaged value: checksum mismatch (corrupt or truncated)")
        if flags & _COMP_MASK:
            payload = memoryview(_decompress(_BITS_KIND[flags & _COMP_MASK], payload))
        if flags & _F_MANIFEST:
            if flags & (_F_OOB | _COMP_MASK):
                raise DecodeError(f"invalid flags 0x{flags:02x} for a chunk manifest")
            return _decode_manifest(payload)
        try:
            if flags & _F_OOB:
                return _loads_oob(payload)
            return pickle.loads(payload)
        except DecodeError:
            raise
        except Exception as exc:  # UnpicklingError, EOFError, ImportError, ...
            raise DecodeError(f"cannot unpickle value: {type(exc).__name__}: {exc}") from exc


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


def _bad_prefix(prefix: bytes) -> DecodeError:
    if prefix[:2] == MAGIC:
        return DecodeError(
            f"unknown format version {prefix[2]} (this asynccache reads version {VERSION}; "
            "the value was written by a different asynccache release)"
        )
    return DecodeError(
        f"not an asynccache value (starts with {prefix!r}): the key holds foreign data"
    )


DEFAULT_CODEC = Codec()
