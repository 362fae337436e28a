"""Object <-> bytes for the store: pickle 5 or pickle-free, header, signing, compression, chunks.

Every value the core writes goes through :meth:`Codec.encode`, and every hit through
:meth:`Codec.decode`, both given the value's full store key (``b"ac:ns:42"``). The common
case (a small value, no arrays) is kept to one ``pickle.dumps``/``pickle.loads``, a 12-byte
header and two xxh3-64 hashes (one of the key, one of the payload).

Blob layout, format version 2 (integers little endian)::

    offset  size  field
    0       2     magic   b"\\xacC"   (0xAC is a UTF-8 continuation byte, so no text, JSON
                                      or pickle (b"\\x80" / b"(") starts with it)
    2       1     format version (2)
    3       1     flags
                    bits 0-1  compression: 0 none, 1 zstd, 2 lz4 (3 is invalid)
                    bit  2    payload has out-of-band buffers (see below)
                    bit  3    payload is a chunk manifest (not user data)
                    bit  4    no checksum: the tag covers key, version and flags only
                    bit  5    signed: the tag is a keyed MAC (Codec(secret=...))
                    bit  6    pickle-free payload (MessagePack, see asynccache.cache.codec.plain)
                    bit  7    reserved, must be 0
    4       T     tag: T = 8 (xxh3-64) without a secret, T = 16 (keyed BLAKE3) with one
    4+T     ...   payload (compressed as a whole when the compression bits are set)

Only the first 4 bytes are fixed. The tag's length and algorithm are fixed by the Codec's
configuration (a secret or not), never read from the stored bytes: a forger cannot
downgrade a signing reader to the checksum, nor a reader without a secret to anything.

==========================  =====  ========================================  ============
configuration               flags  tag                                       header bytes
==========================  =====  ========================================  ============
Codec()                     -      xxh3-64 of key, version, flags, payload   12
Codec(checksum=False)       bit 4  xxh3-64 of key, version, flags            12
Codec(secret=...)           bit 5  BLAKE3-MAC of key, header, payload [:16]  20
Codec(allow_pickle=False)   bit 6  as without it (xxh3-64, or the MAC)       12 (20)
==========================  =====  ========================================  ============

Checksum tag (``H(data, seed)`` is xxh3-64)::

    key_seed = H(key, seed=H(bytes([version, flags])))
    tag      = H(payload, seed=key_seed)      # the stored payload, compressed or not
    tag      = key_seed                       # flag bit 4 (Codec(checksum=False))

So the tag covers the store key, the version, the flags and the payload: bytes copied,
swapped or replayed under another key, a flipped flag and any damage or truncation fail
with ``DecodeError("checksum mismatch: ...")``, never decode as another key's value. The
payload is verified before it is decompressed or unpickled. xxh3-64 is a fast checksum
(~30 µs per MiB), not a MAC: it catches accidents and stale data, not a forger who can
write to the store. A ``checksum=False`` value still binds the key but leaves its payload
unverified, so a ``checksum=True`` Codec refuses it; a ``checksum=False`` Codec reads both
kinds (it verifies a checksummed value in full, since its tag needs the payload).

Signed values (``Codec(secret=...)``, ``Codec.from_env()``)
------------------------------------------------------------

Without a secret, anyone who can ``SET`` a key under a namespace runs code in every
process that reads it: the checksum can be recomputed and decode unpickles. With one::

    mac_key = BLAKE3-derive-key(context="asynccache format 2 value MAC ...", secret)
    tag     = BLAKE3-keyed(mac_key, u64(len(key)) + key + bytes 0..3 + payload)[:16]

The MAC covers the store key (length-prefixed, so key and header cannot trade bytes), the
magic, the version, the flags and the stored payload; it is compared with
:func:`hmac.compare_digest` before any byte is decompressed, unpickled, or parsed (a
manifest included). A signing Codec raises :class:`SignatureError` for everything none of
its secrets signed: foreign bytes, unsigned values (flag bit 5 clear: it never falls back
to the checksum), forged, damaged, truncated, differently-signed values and values copied
under another key. Only another format version stays a :class:`FormatMismatch` (a plain
miss, never decoded), so a rolling upgrade with a shared secret raises no alarm. A reader
without a secret refuses signed values with a DecodeError that says so.

Why keyed BLAKE3 with 16-byte tags: measured on the reference machine (2-core Xeon with
SHA-NI and AVX-512), it costs ~180-195 µs per MiB single-threaded, below the ~270 µs of
zlib.crc32 that the v1 format paid; HMAC-SHA256 costs ~760 µs (SHA-NI), AES-CMAC ~770 µs,
keyed BLAKE2b ~1370 µs. Its multi-threaded mode was no faster on 2 cores (and DataLoader
workers already use every core), so it is not used. A small value costs ~1 µs more to
encode or decode, mostly the blake3 binding's per-call cost. 128 bits make a forgery a
2**-128 guess per attempt, and each attempt costs the attacker a store write and a
victim's read; 32 bytes would only grow every value.

Secrets: ``bytes`` or ``str`` (UTF-8), at least 16 bytes (make one with
``python -c "import secrets; print(secrets.token_hex(32))"``), or a sequence of them: the
first signs, all verify, so a secret is rotated without a flush (``[new, old]`` on every
reader first, then on the writers, then drop ``old``). Values of a retired secret cost one
MAC per secret tried before it. ``Codec.from_env(name="ASYNCCACHE_SECRET")`` reads them from
an environment variable, comma-separated.

Secrets never leave the process: the Codec keeps only BLAKE3 hashers keyed with the
derived keys (no bytes object), and ``repr``, equality, hashing and pickles use
fingerprints (BLAKE3 of the secret under another derivation context; 8 bytes, which
reveal nothing a stored MAC would not). Pickling: a DataLoader worker started with
``spawn``/``forkserver`` unpickles the dataset, codec included (``fork`` inherits memory
and pickles nothing). A Codec from :meth:`Codec.from_env` pickles as the variable's name
plus the fingerprints, and the receiving process reads its own environment (which spawned
workers inherit); it refuses to unpickle if the secrets there differ, rather than turn
every read into a miss. A Codec built with ``secret=...`` refuses to be pickled
(ConfigError naming these two ways out): shipping the secret inside a pickle, which may be
written to disk or sent across machines, is what this feature exists to prevent.
``copy.copy``/``deepcopy`` return the codec itself (it is immutable).

Pickle-free values (``Codec(allow_pickle=False)``)
-------------------------------------------------

Values are written in the format of :mod:`asynccache.cache.codec.plain` (MessagePack for the
structure, out-of-band buffers for tensors and arrays; its docstring lists the types) and
read without ever calling ``pickle.loads``: a pickled value under a key is a DecodeError.
Encode raises EncodeError, naming the conversion, for a type the format lacks. Every Codec
reads pickle-free values (they are safe for all), so writers can switch first. Both
settings combine: ``Codec(secret=..., allow_pickle=False)`` is for a store others can
write to where even a leaked secret must not mean code execution.

What decode raises (all :class:`DecodeError`), checked in this order, before anything is
allocated beyond the input:

* fewer than 4 bytes, or another magic: foreign data (SignatureError with a secret);
* another format version (1 from the previous release, or a future one):
  :class:`FormatMismatch`, which the core treats as a plain miss;
* a blob over ``max_value_bytes``;
* with a secret: flag bit 5 clear, or a MAC none of its secrets makes: SignatureError;
  without one: flag bit 5 set (written by a codec with a secret);
* bit 7, compression 3, a compressed, out-of-band or pickle-free manifest, bit 4 with
  bit 5: unknown or invalid flags; flag bit 4 while ``checksum=True``; a pickled value
  while ``allow_pickle=False``;
* without a secret: a wrong checksum;
* a compressed payload whose frame does not record its decompressed size (every
  compressed payload asynccache writes does), or records more than ``max_value_bytes``
  allows: refused before decompressing. Decompression then allocates the recorded size
  only, and a frame holding more than it records fails there;
* a damaged payload: bad frame, bad buffer table, unpickling or pickle-free parse failure.

``max_value_bytes`` bounds the encoded value before compression (header + payload): encode
refuses anything larger (:class:`ValueTooLarge`), so readers with the same bound never
refuse what a writer stored.

Payload kinds (after decompression):

* plain: one pickle stream (or MessagePack stream, bit 6). This is the fast path: no
  buffer table at all.
* out-of-band (bit 2)::

      0    8        length of the pickle (or MessagePack) stream (P)
      8    4        number of buffers (N)
      12   8*N      length of each buffer
      ...  P        pickle stream (protocol 5, buffers referenced by NEXT_BUFFER), or
                    MessagePack stream (buffers referenced by index)
      ...           buffer region: buffer i starts at the next multiple of 16 bytes
                    (relative to the region start; zero padding), ends the blob exactly

  The table comes before the stream so that decode knows where the stream ends without
  parsing it. On decode the buffer region is copied once into a fresh ``bytearray``
  (aligned by the allocator) and the buffers are ``memoryview`` slices of it: the
  returned numpy arrays and torch tensors are writable and own no other copy (a
  compressed value is decompressed first, which is a copy of its own).
* manifest (bit 3): ``<QQQQB`` chunks, size, chunk_size, digest, token length, then the
  token as UTF-8 (never pickled, never compressed, signed like any value by a codec with a
  secret). ``digest`` is the xxh3-64 of the joined chunks, which then decode as one value
  under the main key (its MAC verified in full). Decode checks
  ``chunks == ceil(size / chunk_size)``, ``chunk_size >= MIN_CHUNK_SIZE`` and
  ``size <= max_value_bytes``, so a manifest can never make the core request more than
  ``max_value_bytes / MIN_CHUNK_SIZE`` chunks.

Large numpy arrays go out-of-band through numpy's own protocol-5 support. Plain CPU torch
tensors are reduced by this module (dtype, shape, raw bytes) because torch's default
pickling copies the storage through ``torch.save`` into the stream; views are stored as
their contiguous values (storage sharing between tensors in one value is not kept).
Tensors that need torch's own pickling (autograd, sparse, quantized, non-CPU) use it.

Security: without a secret and with ``allow_pickle=True`` (the default), decoding runs
``pickle.loads`` on whatever the store holds: point such a cache only at stores that only
trusted writers can reach. Otherwise use ``secret=`` and/or ``allow_pickle=False``.
"""

from __future__ import annotations

import functools
import hmac
import io
import os
import pickle
import secrets
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xxhash import xxh3_64, xxh3_64_intdigest

from asynccache.errors import (
    ConfigError,
    DecodeError,
    EncodeError,
    FormatMismatch,
    MissingDependency,
    SignatureError,
    ValueTooLarge,
)

__all__ = [
    "DEFAULT_CODEC",
    "ENV_SECRET",
    "ChunkManifest",
    "Codec",
    "join_chunks",
    "split_chunks",
]

MAGIC = b"\xacC"
VERSION = 2
_FIXED = struct.Struct("<2sBB")  # magic, version, flags: the part of the header every codec shares
_XXH_TAG = struct.Struct("<Q")  # the xxh3-64 tag
HEADER_SIZE = _FIXED.size + _XXH_TAG.size  # 12: the header of every value this release writes

_COMP_MASK = 0b0000_0011
_COMP_ZSTD = 1
_COMP_LZ4 = 2
_F_OOB = 0b0000_0100
_F_MANIFEST = 0b0000_1000
_F_NOCHECK = 0b0001_0000
_F_MAC = 0b0010_0000  # the tag is a keyed BLAKE3 MAC (Codec(secret=...))
_F_PLAIN = 0b0100_0000  # the payload is pickle-free (asynccache.cache.codec.plain)
_KNOWN_FLAGS = _COMP_MASK | _F_OOB | _F_MANIFEST | _F_NOCHECK | _F_MAC | _F_PLAIN

# Signing. The MAC key is derived from each secret with BLAKE3's key-derivation mode, under
# a context naming this format: a secret is never used as a key of another algorithm or
# format, and the fingerprint (derived under another context) reveals nothing of the key.
_MAC_SIZE = 16  # 128-bit tags: forging one takes ~2**127 guesses, each a store round trip
_SIGNED_HEADER_SIZE = _FIXED.size + _MAC_SIZE  # 20
_MAC_CONTEXT = "asynccache format 2 value MAC (keyed BLAKE3, 16-byte tag)"
_FINGERPRINT_CONTEXT = "asynccache format 2 secret fingerprint"
_KEY_LEN = struct.Struct("<Q")  # length prefix of the store key in the MAC input
_MIN_SECRET_BYTES = 16
_MAKE_SECRET = 'python -c "import secrets; print(secrets.token_hex(32))"'
ENV_SECRET = "ASYNCCACHE_SECRET"  # Codec.from_env()'s default variable

# H(bytes([VERSION, flags])) for every flags byte: the seed of the key hash, so the tag
# covers version and flags without hashing a concatenation.
_FLAG_SEEDS = tuple(xxh3_64_intdigest(bytes([VERSION, f])) for f in range(256))
_SEED0 = _FLAG_SEEDS[0]
_SEED_NOCHECK = _FLAG_SEEDS[_F_NOCHECK]
_HOT = struct.Struct("<4sQ")  # fixed header + xxh3 tag, read and written in one call
_PREFIX0 = _FIXED.pack(MAGIC, VERSION, 0)
_PREFIX_NOCHECK = _FIXED.pack(MAGIC, VERSION, _F_NOCHECK)

_OOB_HEAD = struct.Struct("<QI")
_ALIGN = 16  # enough for every numpy / torch dtype; the allocator gives >= 16
_ZEROS = bytes(_ALIGN)
_SLICE_MAX = 2048  # decode copies payloads up to this size instead of making a memoryview
_MANIFEST = struct.Struct("<QQQQB")
MIN_CHUNK_SIZE = 1024  # smallest chunk a manifest may name (bounds the chunk count)
#: The largest blob a chunk manifest can be (signed header, fields, a 255-byte token):
#: a stored value larger than this is never one (``asynccache warm`` relies on it).
MAX_MANIFEST_BLOB = _SIGNED_HEADER_SIZE + _MANIFEST.size + 255
_MIN_VALUE_BYTES = 4096  # floor of max_value_bytes: the hot paths need no bound check
_U64_MAX = 2**64 - 1

_MISMATCH = "checksum mismatch: damaged, truncated, or written under another key"
_FORGED = (
    "signature mismatch: signed by none of this Codec's secrets (forged, damaged, truncated, "
    "signed with another secret, or written under another key)"
)

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
    """One frame that records its content size (both libraries' default), which decode needs."""
    mod = _import_backend(kind)
    if kind == "zstd":
        return mod.compress(data, 3 if level is None else level)
    return mod.compress(data, compression_level=0 if level is None else level)


def _decompress(kind: str, data: bytes | memoryview, limit: int) -> bytes:
    """Decompress one frame into at most ``limit`` bytes, allocating no more than that.

    Both libraries size their output buffer from the frame's recorded content size (zstd
    even ignores ``max_output_size`` when one is recorded), so that size is read and
    bounded first; a frame that records none is refused (asynccache never writes one), and
    one that holds more than it records fails inside the library at the recorded size.
    Peak memory is the recorded size (zstd) or twice it (python-lz4 copies its buffer into
    the returned bytes).
    """
    try:
        mod = _import_backend(kind)
    except ImportError as exc:
        raise DecodeError(
            f"value is {kind}-compressed but {_PACKAGES[kind]} is not installed: "
            f"pip install {_PACKAGES[kind]}"
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
        if self.digest > _U64_MAX:
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
        _check_chunk_size(chunk_size)
        size = memoryview(blob).nbytes
        return cls(
            chunks=-(-size // chunk_size),
            size=size,
            chunk_size=chunk_size,
            digest=xxh3_64_intdigest(blob),
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
    """Reassemble chunks; any missing, stale or damaged chunk raises DecodeError.

    Count and total length are checked before joining, so nothing is allocated for a set
    of parts that cannot be the value.
    """
    if len(parts) != manifest.chunks:
        raise DecodeError(f"chunked value has {len(parts)} chunks, manifest says {manifest.chunks}")
    total = sum(memoryview(p).nbytes for p in parts)
    if total != manifest.size:
        raise DecodeError(f"chunked value is {total} bytes, manifest says {manifest.size}")
    blob = b"".join(parts)
    if xxh3_64_intdigest(blob) != manifest.digest:
        raise DecodeError("chunked value does not match its manifest checksum (stale or damaged)")
    return blob


def _decode_manifest(payload: bytes | memoryview, max_value_bytes: int) -> ChunkManifest:
    """Parse and bound a manifest: nothing is allocated nor requested for a forged one."""
    if len(payload) < _MANIFEST.size:
        raise DecodeError("truncated chunk manifest")
    chunks, size, chunk_size, digest, token_len = _MANIFEST.unpack_from(payload)
    if len(payload) != _MANIFEST.size + token_len:
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
            chunks, size, chunk_size, digest, str(payload[_MANIFEST.size :], "utf-8")
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"invalid chunk manifest: {exc}") from exc


# --------------------------------------------------------------------------- payloads


def _oob_parts(stream: bytes, raws: Sequence[Any]) -> tuple[list[Any], int]:
    """(parts, total length) of an out-of-band payload: table, stream, aligned buffers."""
    lengths = [memoryview(r).nbytes for r in raws]
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
    return parts, len(table) + len(stream) + pos


def _split_oob(payload: bytes | memoryview) -> tuple[bytes | memoryview, list[memoryview]]:
    """(stream, buffers) of an out-of-band payload; the buffer region is copied exactly once.

    Every count and length is checked against the payload size before it is used, so a
    forged table cannot make ``struct`` or the span list allocate more than the input.
    The buffers are slices of one fresh ``bytearray``: writable, owning no other copy.
    """
    total = len(payload)
    if total < _OOB_HEAD.size:
        raise DecodeError("truncated buffer table")
    stream_len, nbuf = _OOB_HEAD.unpack_from(payload)
    table_end = _OOB_HEAD.size + 8 * nbuf
    if table_end > total:
        raise DecodeError(
            f"buffer table claims {nbuf} buffers, more than a {total}-byte payload can hold"
        )
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
    return payload[table_end:region_start], [region[a:b] for a, b in spans]


_codec_plain: Any = None


def _plain() -> Any:
    """:mod:`asynccache.cache.codec.plain`, imported on first use (msgpack costs ~5 ms to import).

    ImportError escapes: Codec(allow_pickle=False) turns it into MissingDependency, decode
    into a DecodeError.
    """
    global _codec_plain
    if _codec_plain is None:
        from . import plain as codec_plain

        _codec_plain = codec_plain
    return _codec_plain


def _encode_error(obj: object, exc: BaseException) -> EncodeError:
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return EncodeError(
        f"cannot encode a value of type {name}: {exc}. Make it picklable "
        "(no lambdas, locks, open files or sockets; define __reduce__/__getstate__) "
        "or pass a custom codec (codec=...)."
    )


def _unpickle_error(exc: Exception) -> DecodeError:
    return DecodeError(f"cannot unpickle value: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- secrets


Secret = bytes | bytearray | str


def _secret_list(secret: Secret | Sequence[Secret]) -> list[bytes]:
    """The secrets as bytes, first (signing) one first; ConfigError that never shows them."""
    items = [secret] if isinstance(secret, (bytes, bytearray, str)) else secret
    if not isinstance(items, Sequence) or not items:
        raise ConfigError(
            f"secret must be bytes or str, or a non-empty sequence of them (the first signs, "
            f"all verify); got {type(secret).__name__}. Make one with {_MAKE_SECRET}"
        )
    out = []
    for i, item in enumerate(items, 1):
        if isinstance(item, str):
            item = item.encode("utf-8")
        if not isinstance(item, (bytes, bytearray)):
            raise ConfigError(f"secret {i} of {len(items)} is a {type(item).__name__}, not bytes")
        if len(item) < _MIN_SECRET_BYTES:
            raise ConfigError(
                f"secret {i} of {len(items)} is {len(item)} bytes; a secret needs at least "
                f"{_MIN_SECRET_BYTES} (random ones): make one with {_MAKE_SECRET}"
            )
        out.append(bytes(item))
    return out


class _Signer:
    """Keyed BLAKE3 hashers derived from a Codec's secrets: the first signs, all verify.

    Only derived keys are kept, inside blake3 hasher objects: there is no Python bytes
    object holding key material to print, compare or pickle (blake3 hashers refuse to be
    pickled or copied with :mod:`copy`). Each call starts from a ``copy()`` of the keyed
    hasher, which skips the key setup.
    """

    __slots__ = ("_hashers", "fingerprints")

    def __init__(self, secrets: list[bytes]) -> None:
        try:
            import blake3
        except ImportError as exc:
            raise MissingDependency(
                "Codec(secret=...) needs the blake3 package: pip install blake3"
            ) from exc
        self._hashers = tuple(
            blake3.blake3(key=blake3.blake3(s, derive_key_context=_MAC_CONTEXT).digest())
            for s in secrets
        )
        # What __eq__, __hash__, repr and pickles carry instead of the secrets.
        self.fingerprints = tuple(
            blake3.blake3(s, derive_key_context=_FINGERPRINT_CONTEXT).hexdigest(8) for s in secrets
        )

    def sign(self, parts: Sequence[Any]) -> bytes:
        """The tag of the concatenated ``parts`` (hashed one by one, never joined)."""
        h = self._hashers[0].copy()
        for part in parts:
            h.update(part)
        return h.digest(_MAC_SIZE)

    def verify(self, parts: Sequence[Any], tag: Any) -> bool:
        """True if any secret signed the concatenated ``parts`` with ``tag``.

        Each comparison is constant-time; the number of secrets tried shows in the timing,
        which tells nothing about any key.
        """
        for base in self._hashers:
            h = base.copy()
            for part in parts:
                h.update(part)
            if hmac.compare_digest(h.digest(_MAC_SIZE), tag):
                return True
        return False


def _mac_prefix(key: bytes, fixed: bytes) -> bytes:
    """What the MAC covers before the payload: the length-prefixed store key (so key and
    payload boundaries are unambiguous) and the 4 fixed header bytes (magic, version,
    flags)."""
    return _KEY_LEN.pack(len(key)) + key + fixed


# --------------------------------------------------------------------------- codec


def _check_flags(flags: int, checksum: bool, allow_pickle: bool) -> None:
    """Refuse flag combinations this release never writes, or a Codec so configured never
    reads (:func:`_accepted_flags` tabulates it: decode calls it only to raise)."""
    if flags & ~_KNOWN_FLAGS or flags & _COMP_MASK == _COMP_MASK:
        raise DecodeError(f"unknown flags 0x{flags:02x} (written by a newer asynccache?)")
    if flags & _F_MANIFEST and flags & (_F_OOB | _COMP_MASK | _F_PLAIN):
        raise DecodeError(f"invalid flags 0x{flags:02x} for a chunk manifest")
    if flags & _F_NOCHECK and flags & _F_MAC:
        raise DecodeError(f"invalid flags 0x{flags:02x}: a signed value is always checked")
    if flags & _F_NOCHECK and checksum:
        raise DecodeError(
            "value was written without a checksum (Codec(checksum=False)); this Codec has "
            "checksum=True and never accepts an unverified payload"
        )
    if not allow_pickle and not flags & (_F_PLAIN | _F_MANIFEST):
        raise DecodeError(
            "value is pickled (written by a Codec with allow_pickle=True); this Codec has "
            "allow_pickle=False and never unpickles"
        )


@functools.cache
def _accepted_flags(checksum: bool, allow_pickle: bool) -> frozenset[int]:
    """The flags bytes :func:`_check_flags` accepts: one set lookup per decode."""
    accepted = set()
    for flags in range(256):
        try:
            _check_flags(flags, checksum, allow_pickle)
        except DecodeError:
            continue
        accepted.add(flags)
    return frozenset(accepted)


def _rebuild_codec(kwargs: dict[str, Any]) -> Codec:
    return Codec(**kwargs)


def _rebuild_codec_from_env(
    name: str, fingerprints: tuple[str, ...], kwargs: dict[str, Any]
) -> Codec:
    """Unpickle a ``Codec.from_env`` codec: read the secrets from this process's
    environment, and refuse other ones than the pickling process had (every value would
    be a miss otherwise, silently)."""
    codec = Codec.from_env(name, **kwargs)
    if codec._fingerprints() != fingerprints:
        raise ConfigError(
            f"${name} holds other secrets in this process (fingerprints "
            f"{', '.join(codec._fingerprints())}) than in the process that pickled this Codec "
            f"({', '.join(fingerprints)})"
        )
    return codec


class Codec:
    """Turns cached values into self-describing blobs bound to their store key, and back.

    Compression is applied to the whole payload only when it is at least
    ``compress_threshold`` bytes and only kept when it shrinks it; decode handles every
    compression kind regardless of this codec's setting (values written by a peer with
    another setting stay readable). ``max_value_bytes`` bounds what encode writes and what
    decode accepts or decompresses (header + uncompressed payload), so hostile or damaged
    bytes in the store cannot make a reader allocate more.

    ``secret`` (bytes or str, or a sequence of them: the first signs, all verify) signs
    every value with a keyed MAC and accepts only values it verifies; ``allow_pickle=False``
    writes and reads pickle-free values only (see the module docstring). Both are for
    stores that others can write to; :meth:`from_env` reads the secrets from the
    environment, which is also how a signing codec crosses a pickle.
    """

    __slots__ = (
        "_accepted",
        "_env",
        "_hot",
        "_hot_limit",
        "_hot_signed",
        "_kind",
        "_signer",
        "_tag_size",
        "allow_pickle",
        "checksum",
        "compress_level",
        "compress_threshold",
        "compression",
        "max_value_bytes",
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
        max_value_bytes: int = 256 * 1024 * 1024,
        secret: Secret | Sequence[Secret] | None = None,
        allow_pickle: bool = True,
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
        if type(max_value_bytes) is not int or max_value_bytes < _MIN_VALUE_BYTES:
            raise ConfigError(
                f"max_value_bytes must be an int >= {_MIN_VALUE_BYTES}, got {max_value_bytes!r}"
            )
        if type(allow_pickle) is not bool:
            raise ConfigError(f"allow_pickle must be True or False, got {allow_pickle!r}")
        if secret is not None and not checksum:
            raise ConfigError(
                "checksum=False cannot be combined with a secret: a signature always covers "
                "the whole value"
            )
        self.compression = compression
        self.compress_threshold = compress_threshold
        self.compress_level = compress_level
        self.checksum = bool(checksum)
        self.protocol = protocol
        self.max_value_bytes = max_value_bytes
        self.allow_pickle = allow_pickle
        self._signer = None if secret is None else _Signer(_secret_list(secret))
        self._env: str | None = None  # the variable from_env() read the secrets from
        if not allow_pickle:
            try:
                _plain()
            except ImportError as exc:
                raise MissingDependency(
                    "Codec(allow_pickle=False) needs the msgpack package: pip install msgpack"
                ) from exc
        # Length of the tag after the 4 fixed header bytes, fixed by the configuration:
        # decode never reads it (nor the MAC algorithm) from the stored bytes.
        self._tag_size = _XXH_TAG.size if self._signer is None else _MAC_SIZE
        self._kind = _resolve_compression(compression)
        # Hot paths (unsigned pickled values): encode takes its one for payloads shorter
        # than _hot_limit, decode for values starting with _hot (b"" never matches).
        plain_unsigned = self._signer is None and allow_pickle
        if not plain_unsigned:
            self._hot_limit = -1
        elif self._kind is None:
            self._hot_limit = sys.maxsize
        else:
            self._hot_limit = compress_threshold
        self._hot = _PREFIX0 if plain_unsigned else b""
        # ... and for small signed values (flags MAC, + PLAIN without pickle), with a secret.
        signed = _FIXED.pack(MAGIC, VERSION, _F_MAC if allow_pickle else _F_MAC | _F_PLAIN)
        self._hot_signed = b"" if self._signer is None else signed
        self._accepted = _accepted_flags(self.checksum, allow_pickle)
        if self._kind is not None and compress_level is not None:
            try:  # fail now, not on the first large value
                _compress(self._kind, b"x", compress_level)
            except Exception as exc:
                raise ConfigError(
                    f"compress_level={compress_level!r} is not valid for {self._kind}: {exc}"
                ) from exc

    @classmethod
    def from_env(cls, name: str = ENV_SECRET, **options: Any) -> Codec:
        """A signing Codec whose secrets are in the environment variable ``name``.

        The variable holds one secret, or several separated by commas (the first signs,
        all verify; surrounding spaces are ignored, so a secret cannot contain a comma).
        Unlike one built with ``secret=``, this codec can be pickled: the pickle names the
        variable and the secrets' fingerprints, and the receiving process (a spawned
        DataLoader worker) reads the variable itself. ``options`` are the other
        :class:`Codec` arguments.
        """
        raw = os.environ.get(name)
        if raw is None:
            raise ConfigError(
                f"environment variable {name} is not set: export {name}=\"$({_MAKE_SECRET})\" "
                "(several secrets: comma-separated, the signing one first)"
            )
        parts = [part.strip() for part in raw.split(",")]
        if not all(parts):
            raise ConfigError(f"${name} has an empty secret (two commas, or a trailing comma)")
        codec = cls(secret=parts, **options)
        codec._env = name
        return codec

    # -- identity -------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "compression": self.compression,
            "compress_threshold": self.compress_threshold,
            "compress_level": self.compress_level,
            "checksum": self.checksum,
            "protocol": self.protocol,
            "max_value_bytes": self.max_value_bytes,
            "allow_pickle": self.allow_pickle,
        }

    def _fingerprints(self) -> tuple[str, ...]:
        return () if self._signer is None else self._signer.fingerprints

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return (self._config(), self._fingerprints()) == (other._config(), other._fingerprints())

    def __hash__(self) -> int:
        return hash((*self._config().values(), self._fingerprints()))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        if self._signer is not None:
            where = f"${self._env}, " if self._env else ""
            args += f", secret=<{where}fingerprints {', '.join(self._fingerprints())}>"
        return f"Codec({args})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Re-run __init__ in the receiving process, so "auto" picks what is installed there.
        if self._signer is None:
            return _rebuild_codec, (self._config(),)
        if self._env is None:
            raise ConfigError(
                "a Codec built with secret=... cannot be pickled (the secret would travel "
                "in the pickle): build it with Codec.from_env() so that each process reads "
                "the secret from its environment, or start DataLoader workers with "
                "multiprocessing_context='fork'"
            )
        return _rebuild_codec_from_env, (self._env, self._fingerprints(), self._config())

    def __copy__(self) -> Codec:
        return self  # immutable: copies (of a dataset holding it) share it, secret included

    def __deepcopy__(self, memo: dict[int, Any]) -> Codec:
        return self

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

    def _too_large(self, size: int) -> ValueTooLarge:
        return ValueTooLarge(
            f"value is {size} bytes encoded, over max_value_bytes={self.max_value_bytes}; "
            "raise max_value_bytes in Codec(...)"
        )

    def _finish(
        self, key: bytes, flags: int, parts: list[Any], size: int, compress: bool = True
    ) -> bytes:
        """Bound, compress if worthwhile, tag or sign, and join everything once.

        ``size`` is the payload length before compression: the bound applies to it, so a
        reader never has to decompress more than ``max_value_bytes``.
        """
        encoded = _FIXED.size + self._tag_size + size
        if encoded > self.max_value_bytes:
            raise self._too_large(encoded)
        if compress and self._kind is not None and size >= self.compress_threshold:
            packed = _compress(self._kind, b"".join(parts), self.compress_level)
            if len(packed) < size:
                parts = [packed]
                flags |= _KIND_BITS[self._kind]
        if self._signer is not None:
            fixed = _FIXED.pack(MAGIC, VERSION, flags | _F_MAC)
            tag = self._signer.sign([_mac_prefix(key, fixed), *parts])
            return b"".join([fixed, tag, *parts])
        if self.checksum:
            hasher = xxh3_64(seed=xxh3_64_intdigest(key, _FLAG_SEEDS[flags]))
            for part in parts:  # one pass over the payload, no concatenation
                hasher.update(part)
            tag = hasher.intdigest()
        else:
            flags |= _F_NOCHECK
            tag = xxh3_64_intdigest(key, _FLAG_SEEDS[flags])
        return b"".join([_FIXED.pack(MAGIC, VERSION, flags), _XXH_TAG.pack(tag), *parts])

    def encode(self, obj: object, key: bytes) -> bytes:
        """Serialise ``obj`` for the store key ``key`` (only ``decode(blob, key)`` reads it).

        EncodeError (chained) if it cannot be pickled, or with ``allow_pickle=False`` is of
        a type the pickle-free format lacks (the message says how to convert it);
        ValueTooLarge if it is encoded over ``max_value_bytes``.
        """
        if type(obj) is ChunkManifest:
            raise EncodeError("ChunkManifest is reserved for chunked values: use encode_manifest")
        if type(obj) is memoryview:  # bytes-like, but not picklable: stored (and read) as bytes
            obj = obj.tobytes()
        if not self.allow_pickle:
            stream, raws = _plain().dumps(obj)
            if not raws:
                return self._finish(key, _F_PLAIN, [stream], len(stream))
            return self._finish(key, _F_PLAIN | _F_OOB, *_oob_parts(stream, raws))
        try:
            stream, bufs = self._pickle(obj)
            if not bufs:  # fast path: header + pickle stream
                n = len(stream)
                if n < self._hot_limit:  # unsigned, and not to be compressed
                    if n + HEADER_SIZE > self.max_value_bytes:
                        raise self._too_large(n + HEADER_SIZE)
                    if self.checksum:
                        tag = xxh3_64_intdigest(stream, xxh3_64_intdigest(key, _SEED0))
                        return _HOT.pack(_PREFIX0, tag) + stream
                    return (
                        _HOT.pack(_PREFIX_NOCHECK, xxh3_64_intdigest(key, _SEED_NOCHECK)) + stream
                    )
                return self._finish(key, 0, [stream], n)
            raws = [b.raw() for b in bufs]
        except EncodeError:
            raise
        except Exception as exc:  # PicklingError, TypeError, AttributeError, BufferError, ...
            raise _encode_error(obj, exc) from exc
        return self._finish(key, _F_OOB, *_oob_parts(stream, raws))

    def encode_manifest(self, manifest: ChunkManifest, key: bytes) -> bytes:
        """Serialise a chunk manifest for ``key`` (never pickled, never compressed; signed
        by a codec with a secret like any value).

        Refuses what decode would refuse: a value over ``max_value_bytes`` (ValueTooLarge)
        or chunks under ``MIN_CHUNK_SIZE`` bytes (EncodeError).
        """
        if not isinstance(manifest, ChunkManifest):
            raise EncodeError(f"expected a ChunkManifest, got {type(manifest).__qualname__}")
        if manifest.size > self.max_value_bytes:
            raise self._too_large(manifest.size)
        if manifest.chunk_size < MIN_CHUNK_SIZE:
            raise EncodeError(
                f"chunk_size={manifest.chunk_size} is under MIN_CHUNK_SIZE={MIN_CHUNK_SIZE}: "
                "readers refuse such a manifest"
            )
        token = manifest.token.encode("utf-8")
        payload = _MANIFEST.pack(
            manifest.chunks, manifest.size, manifest.chunk_size, manifest.digest, len(token)
        )
        return self._finish(key, _F_MANIFEST, [payload, token], len(payload) + len(token), False)

    # -- decode ---------------------------------------------------------------------------

    def decode(self, data: bytes | bytearray | memoryview, key: bytes) -> object:
        """Inverse of encode/encode_manifest for the same ``key``.

        DecodeError for anything else: foreign bytes, damage, a value of another key, input
        over the bounds; FormatMismatch (a DecodeError) for another format version; with a
        secret, SignatureError (a DecodeError) for every value none of its secrets signed.
        """
        if type(data) is bytes and len(data) <= _SLICE_MAX:
            # Hot path: a small cached value with flags 0, read from the store as bytes,
            # by a codec that unpickles unsigned values (self._hot is b"" otherwise).
            # (max_value_bytes >= _MIN_VALUE_BYTES > _SLICE_MAX: no bound to check.)
            try:
                prefix, tag = _HOT.unpack_from(data)
            except struct.error:
                prefix = None
            if prefix == self._hot:
                payload = data[HEADER_SIZE:]
                if xxh3_64_intdigest(payload, xxh3_64_intdigest(key, _SEED0)) != tag:
                    raise DecodeError(_MISMATCH)
                try:
                    return pickle.loads(payload)
                except Exception as exc:
                    raise _unpickle_error(exc) from exc
            if prefix == self._hot_signed:  # as _decode, without its general cases
                payload = data[_SIGNED_HEADER_SIZE:]
                mac_input = _mac_prefix(key, prefix) + payload  # small: one hash update
                if not self._signer.verify([mac_input], data[_FIXED.size : _SIGNED_HEADER_SIZE]):
                    raise SignatureError(_FORGED)
                if not self.allow_pickle:
                    return _plain().loads(payload)
                try:
                    return pickle.loads(payload)
                except Exception as exc:
                    raise _unpickle_error(exc) from exc
        return self._decode(data, key)

    def _unverified(self, message: str) -> DecodeError:
        """The error for bytes rejected before their tag was checked: with a secret, a
        SignatureError (whoever wrote them did not hold it)."""
        return DecodeError(message) if self._signer is None else SignatureError(message)

    def _decode(self, data: bytes | bytearray | memoryview, key: bytes) -> object:
        """Every case but the hot path; checks run in the order the module docstring lists."""
        try:
            magic, version, flags = _FIXED.unpack_from(data)
        except struct.error as exc:
            raise self._unverified(
                f"not an asynccache value: {_describe(data)} is shorter than the header"
            ) from exc
        except (TypeError, ValueError, BufferError) as exc:
            raise DecodeError(
                f"not an asynccache value: cannot read a {type(data).__name__} as bytes"
            ) from exc
        if magic != MAGIC:
            raise self._unverified(
                f"not an asynccache value (starts with {_FIXED.pack(magic, version, flags)!r}): "
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
            view = data if size <= _SLICE_MAX else memoryview(data)  # never copy a large one
        else:
            view = _byte_view(data)
            size = len(view)
        if size > self.max_value_bytes:
            raise DecodeError(f"value is {size} bytes, over max_value_bytes={self.max_value_bytes}")
        start = _FIXED.size + self._tag_size
        payload = view[start:]
        signer = self._signer
        if signer is not None:  # verify first: nothing of a forgery is looked at
            if not flags & _F_MAC:
                raise SignatureError(
                    "value is not signed: written by a Codec without a secret, or forged"
                )
            prefix = _mac_prefix(key, bytes(view[: _FIXED.size]))
            if size < start or not signer.verify([prefix, payload], view[_FIXED.size : start]):
                raise SignatureError(_FORGED)
            if flags not in self._accepted:
                _check_flags(flags, self.checksum, self.allow_pickle)
        else:
            if flags & _F_MAC:
                raise DecodeError(
                    "value is signed: written by a Codec with a secret (Codec(secret=...) or "
                    "Codec.from_env()); this Codec has none, so it cannot verify it"
                )
            if flags not in self._accepted:
                _check_flags(flags, self.checksum, self.allow_pickle)
            key_seed = xxh3_64_intdigest(key, _FLAG_SEEDS[flags])
            tag = key_seed if flags & _F_NOCHECK else xxh3_64_intdigest(payload, key_seed)
            if view[_FIXED.size : start] != _XXH_TAG.pack(tag):
                raise DecodeError(_MISMATCH)
        if flags & _COMP_MASK:
            kind = _BITS_KIND[flags & _COMP_MASK]
            payload = memoryview(_decompress(kind, payload, self.max_value_bytes - start))
        if flags & _F_MANIFEST:
            return _decode_manifest(payload, self.max_value_bytes)
        if flags & _F_PLAIN:
            try:
                plain = _plain()
            except ImportError as exc:
                raise DecodeError(
                    "value is pickle-free but msgpack is not installed: pip install msgpack"
                ) from exc
            if flags & _F_OOB:
                return plain.loads(*_split_oob(payload))
            return plain.loads(payload)
        try:
            if flags & _F_OOB:
                stream, buffers = _split_oob(payload)
                return pickle.loads(stream, buffers=buffers)
            return pickle.loads(payload)
        except DecodeError:
            raise
        except Exception as exc:  # UnpicklingError, EOFError, ImportError, ...
            raise _unpickle_error(exc) from exc


def _byte_view(data: bytearray | memoryview) -> memoryview:
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


DEFAULT_CODEC = Codec()
