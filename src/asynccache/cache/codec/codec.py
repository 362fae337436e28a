"""``Codec``: cached values to self-describing bytes bound to their store key, and back.

Pickle 5 (or pickle-free, ``allow_pickle=False``), a 12-byte header with an xxh3-64 tag
of key and payload (a keyed BLAKE3 MAC with ``secret=``), compression of large payloads,
chunk manifests. The format, the checks decode makes and why: docs/formats.md. Without
a secret and with ``allow_pickle=True`` (the default), decoding unpickles whatever the
store holds: point such a cache only at stores that only trusted writers can reach.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from collections.abc import Sequence
from typing import Any

from xxhash import xxh3_64, xxh3_64_intdigest

from ..._interrupts import raised_in_signal_handler
from ...errors import (
    ConfigError,
    DecodeError,
    EncodeError,
    MissingDependency,
    SignatureError,
    ValueTooLarge,
)
from .compression import (
    COMPRESSIONS,
    KIND_BITS,
    compress,
    resolve_compression,
)
from .format import (
    F_MAC,
    F_MANIFEST,
    F_NOCHECK,
    F_OOB,
    F_PLAIN,
    FIXED,
    FLAG_SEEDS,
    FORGED,
    HEADER_SIZE,
    HOT,
    MAC_SIZE,
    MAGIC,
    MISMATCH,
    PREFIX0,
    PREFIX_NOCHECK,
    SEED0,
    SEED_NOCHECK,
    SEED_OOB,
    SIGNED_HEADER_SIZE,
    VERSION,
    XXH_TAG,
    accepted_flags,
)
from .general import SLICE_MAX, DecodeRules, decode_general, plain_module
from .mac import ENV_SECRET, MAKE_SECRET, Secret, Signer, mac_prefix, secret_list
from .manifest import (
    MANIFEST,
    MAX_MANIFEST_BLOB,
    MIN_CHUNK_SIZE,
    ChunkManifest,
    join_chunks,
    split_chunks,
)
from .pickling import (
    ATOMIC,
    BIG_BYTES,
    bytes_stream,
    dumps_special,
    encode_error,
    oob_parts,
    split_oob,
    unpickle_error,
)

__all__ = [
    "DEFAULT_CODEC",
    "ENV_SECRET",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_MANIFEST_BLOB",
    "MIN_CHUNK_SIZE",
    "ChunkManifest",
    "Codec",
    "join_chunks",
    "split_chunks",
]

_OOB_HOT_TYPES = (bytes, bytearray, memoryview)  # what readers hand decode()
_MIN_VALUE_BYTES = 4096  # floor of max_value_bytes: the hot paths need no bound check


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

    Decode handles every compression kind regardless of this codec's setting (values
    written by a peer with another setting stay readable). ``secret`` and
    ``allow_pickle=False`` are for stores that others can write to; `from_env()` reads
    the secrets from the environment, which is also how a signing codec crosses a pickle.

    Args:
        compression: ``None``, ``"zstd"``, ``"lz4"`` or ``"auto"``; applied to the whole
            payload only when it is at least ``compress_threshold`` bytes, and only kept
            when it shrinks it.
        compress_threshold: the smallest payload compressed, in bytes.
        compress_level: the compressor's level (``None``: its default).
        checksum: the tag bound to the key covers the payload too; ``False``: the key,
            version and flags only (a ``secret`` needs ``True``).
        protocol: the pickle protocol.
        max_value_bytes: bound on what encode writes and what decode accepts or
            decompresses (header + uncompressed payload), so hostile or damaged bytes in
            the store cannot make a reader allocate more.
        secret: bytes or str, or a sequence of them (the first signs, all verify): every
            value is signed with a keyed MAC and only values it verifies are accepted.
        allow_pickle: ``False`` writes and reads pickle-free values only (see
            docs/formats.md); reading never unpickles.
    """

    __slots__ = (
        "_accepted",
        "_env",
        "_hot",
        "_hot_limit",
        "_hot_oob",
        "_hot_signed",
        "_kind",
        "_rules",
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
        if compression not in COMPRESSIONS:
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
        self._signer = None if secret is None else Signer(secret_list(secret))
        self._env: str | None = None  # the variable from_env() read the secrets from
        if not allow_pickle:
            try:
                plain_module()
            except ImportError as exc:
                raise MissingDependency(
                    "Codec(allow_pickle=False) needs the msgpack package: pip install msgpack"
                ) from exc
        # Length of the tag after the 4 fixed header bytes, fixed by the configuration:
        # decode never reads it (nor the MAC algorithm) from the stored bytes.
        self._tag_size = XXH_TAG.size if self._signer is None else MAC_SIZE
        self._kind = resolve_compression(compression)
        # Hot paths (unsigned pickled values): encode takes its one for payloads shorter
        # than _hot_limit, decode for values starting with _hot (b"" never matches).
        plain_unsigned = self._signer is None and allow_pickle
        if not plain_unsigned:
            self._hot_limit = -1
        elif self._kind is None:
            self._hot_limit = sys.maxsize
        else:
            self._hot_limit = compress_threshold
        self._hot = PREFIX0 if plain_unsigned else b""
        self._hot_oob = FIXED.pack(MAGIC, VERSION, F_OOB) if plain_unsigned else b""
        # ... and for small signed values (flags MAC, + PLAIN without pickle), with a secret.
        signed = FIXED.pack(MAGIC, VERSION, F_MAC if allow_pickle else F_MAC | F_PLAIN)
        self._hot_signed = b"" if self._signer is None else signed
        self._accepted = accepted_flags(self.checksum, allow_pickle)
        #: what the general decode checks values against
        self._rules = DecodeRules(self._signer, self._accepted, self.checksum, allow_pickle,
                                  max_value_bytes, self._tag_size)
        if self._kind is not None and compress_level is not None:
            try:  # fail now, not on the first large value
                compress(self._kind, b"x", compress_level)
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
        DataLoader worker) reads the variable itself.

        Args:
            name: the environment variable.
            **options: the other `Codec` arguments.

        Raises:
            ConfigError: the variable is not set, or holds an empty secret.
        """
        raw = os.environ.get(name)
        if raw is None:
            raise ConfigError(
                f"environment variable {name} is not set: export {name}=\"$({MAKE_SECRET})\" "
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
        if type(obj) in ATOMIC or self.protocol < 5:
            return pickle.dumps(obj, self.protocol), []
        if "torch" in sys.modules or "numpy" in sys.modules:  # arrays: see `reduce_array`
            return dumps_special(obj, self.protocol)
        bufs: list[pickle.PickleBuffer] = []
        stream = pickle.dumps(obj, self.protocol, buffer_callback=bufs.append)
        if bufs and any(memoryview(b).readonly for b in bufs):  # rare: read-only arrays
            return dumps_special(obj, self.protocol)
        return stream, bufs

    def _too_large(self, size: int) -> ValueTooLarge:
        return ValueTooLarge(
            f"value is {size} bytes encoded, over max_value_bytes={self.max_value_bytes}; "
            "raise max_value_bytes in Codec(...)"
        )

    def _finish(
        self, key: bytes, flags: int, parts: list[Any], size: int, compressible: bool = True
    ) -> bytes:
        """Bound, compress if worthwhile, tag or sign, and join everything once.

        ``size`` is the payload length before compression: the bound applies to it, so a
        reader never has to decompress more than ``max_value_bytes``.
        """
        encoded = FIXED.size + self._tag_size + size
        if encoded > self.max_value_bytes:
            raise self._too_large(encoded)
        if compressible and self._kind is not None and size >= self.compress_threshold:
            packed = compress(self._kind, b"".join(parts), self.compress_level)
            if len(packed) < size:
                parts = [packed]
                flags |= KIND_BITS[self._kind]
        if self._signer is not None:
            fixed = FIXED.pack(MAGIC, VERSION, flags | F_MAC)
            mac = self._signer.sign([mac_prefix(key, fixed), *parts])
            return b"".join([fixed, mac, *parts])
        if self.checksum:
            hasher = xxh3_64(seed=xxh3_64_intdigest(key, FLAG_SEEDS[flags]))
            for part in parts:  # one pass over the payload, no concatenation
                hasher.update(part)
            tag = hasher.intdigest()
        else:
            flags |= F_NOCHECK
            tag = xxh3_64_intdigest(key, FLAG_SEEDS[flags])
        return b"".join([FIXED.pack(MAGIC, VERSION, flags), XXH_TAG.pack(tag), *parts])

    def encode(self, obj: object, key: bytes) -> bytes:
        """Serialise ``obj`` for the store key ``key`` (only ``decode(blob, key)`` reads it).

        Raises:
            EncodeError: (chained) ``obj`` cannot be pickled, or with
                ``allow_pickle=False`` is of a type the pickle-free format lacks (the
                message says how to convert it).
            ValueTooLarge: it is encoded over ``max_value_bytes``.
        """
        if type(obj) is ChunkManifest:
            raise EncodeError("ChunkManifest is reserved for chunked values: use encode_manifest")
        if type(obj) is memoryview:  # bytes-like, but not picklable: stored (and read) as bytes
            obj = obj.tobytes()
        if not self.allow_pickle:
            stream, raws = plain_module().dumps(obj)
            if not raws:
                return self._finish(key, F_PLAIN, [stream], len(stream))
            return self._finish(key, F_PLAIN | F_OOB, *oob_parts(stream, raws))
        if type(obj) is bytes and len(obj) >= BIG_BYTES and self.protocol >= 4:
            parts = bytes_stream(obj, self.protocol)  # one copy (the join), not two
            return self._finish(key, 0, parts, len(obj) + len(parts[0]) + 1)
        try:
            stream, bufs = self._pickle(obj)
            if not bufs:  # fast path: header + pickle stream
                n = len(stream)
                if n < self._hot_limit:  # unsigned, and not to be compressed
                    if n + HEADER_SIZE > self.max_value_bytes:
                        raise self._too_large(n + HEADER_SIZE)
                    if self.checksum:
                        tag = xxh3_64_intdigest(stream, xxh3_64_intdigest(key, SEED0))
                        return HOT.pack(PREFIX0, tag) + stream
                    return (
                        HOT.pack(PREFIX_NOCHECK, xxh3_64_intdigest(key, SEED_NOCHECK)) + stream
                    )
                return self._finish(key, 0, [stream], n)
            raws = [b.raw() for b in bufs]
        except EncodeError:
            raise
        except Exception as exc:  # PicklingError, TypeError, AttributeError, BufferError, ...
            if raised_in_signal_handler(exc):
                raise
            raise encode_error(obj, exc) from exc
        return self._finish(key, F_OOB, *oob_parts(stream, raws, FIXED.size + self._tag_size))

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
        payload = MANIFEST.pack(
            manifest.chunks, manifest.size, manifest.chunk_size, manifest.digest, len(token)
        )
        return self._finish(key, F_MANIFEST, [payload, token], len(payload) + len(token), False)

    # -- decode ---------------------------------------------------------------------------

    def decode(self, data: bytes | bytearray | memoryview, key: bytes,
               owned: bool = False) -> object:
        """Inverse of encode/encode_manifest for the same ``key``.

        ``owned``: ``data`` is writable memory that belongs to this value alone, starts
        where its allocation starts and is never reused (a buffer a reader received this
        one value into): the arrays, tensors and buffers of the value are then views of
        it instead of a copy. The caller must not read ``data`` as the value's bytes
        after handing it over (the value may be changed in place through them).

        Raises:
            DecodeError: for anything else: foreign bytes, damage, a value of another key,
                input over the bounds.
            FormatMismatch: (a DecodeError) another format version.
            SignatureError: (a DecodeError, with a secret) a value none of its secrets
                signed.
        """
        if type(data) is bytes and len(data) <= SLICE_MAX:
            # Hot path: a small cached value with flags 0, read from the store as bytes,
            # by a codec that unpickles unsigned values (self._hot is b"" otherwise).
            # (max_value_bytes >= _MIN_VALUE_BYTES > SLICE_MAX: no bound to check.)
            try:
                prefix, tag = HOT.unpack_from(data)
            except struct.error:
                prefix = None
            payload: bytes | None = None
            if prefix == self._hot:
                payload = data[HEADER_SIZE:]
                if xxh3_64_intdigest(payload, xxh3_64_intdigest(key, SEED0)) != tag:
                    raise DecodeError(MISMATCH)
            # as _decode, without its general cases (with no signer _hot_signed is b"",
            # which no prefix equals)
            elif prefix == self._hot_signed and self._signer is not None:
                payload = data[SIGNED_HEADER_SIZE:]
                mac_input = mac_prefix(key, prefix) + payload  # small: one hash update
                if not self._signer.verify([mac_input], data[FIXED.size : SIGNED_HEADER_SIZE]):
                    raise SignatureError(FORGED)
                if not self.allow_pickle:
                    return plain_module().loads(payload)
            if payload is not None:
                try:
                    return pickle.loads(payload)
                except Exception as exc:
                    if raised_in_signal_handler(exc):
                        raise
                    raise unpickle_error(exc) from exc
        if self._hot_oob and type(data) in _OOB_HOT_TYPES:
            # Hot path of arrays and tensors: flags F_OOB alone (pickled out-of-band,
            # unsigned, not compressed), as _decode takes it, without its other cases.
            try:
                prefix, tag = HOT.unpack_from(data)
            except struct.error:
                prefix = None
            if prefix == self._hot_oob:
                view = data if type(data) is memoryview else memoryview(data)
                if view.ndim == 1 and view.itemsize == 1 \
                        and len(view) <= self.max_value_bytes:
                    body = view[HEADER_SIZE:]
                    if xxh3_64_intdigest(body, xxh3_64_intdigest(key, SEED_OOB)) != tag:
                        raise DecodeError(MISMATCH)
                    stream, buffers = split_oob(
                        body, HEADER_SIZE if owned and not view.readonly else None)
                    try:
                        return pickle.loads(stream, buffers=buffers)
                    except Exception as exc:
                        if raised_in_signal_handler(exc):
                            raise
                        raise unpickle_error(exc) from exc
        return self._decode(data, key, owned)

    def decode_hot(self, blobs: Sequence[Any], keys: Sequence[bytes], out: list[Any]
                   ) -> tuple[list[int], int, int]:
        """Decode, in one call, the values of a reply that `decode()`'s hot path takes
        (small ``bytes`` with flags 0, by a codec that unpickles unsigned values) into
        ``out[i]``. Returns the positions left to `decode()` one by one (absent, not
        read, other kinds, and damage: decode then says what is wrong), and the bytes
        and the largest value of those decoded here. A reply of small values costs one
        Python call instead of one per value."""
        hot = self._hot
        if not hot:  # signed or pickle-free: every value takes the general path
            return list(range(len(blobs))), 0, 0
        rest: list[int] = []
        tag_of = XXH_TAG.unpack_from
        xxh = xxh3_64_intdigest
        loads = pickle.loads
        nbytes = largest = 0
        for i, data in enumerate(blobs):
            if type(data) is bytes and HEADER_SIZE <= (n := len(data)) <= SLICE_MAX \
                    and data.startswith(hot):
                payload = data[HEADER_SIZE:]
                if xxh(payload, xxh(keys[i], SEED0)) == tag_of(data, 4)[0]:
                    try:
                        out[i] = loads(payload)
                    except Exception as exc:
                        if raised_in_signal_handler(exc):
                            raise
                    else:
                        nbytes += n
                        if n > largest:
                            largest = n
                        continue
            rest.append(i)
        return rest, nbytes, largest

    def _decode(self, data: bytes | bytearray | memoryview, key: bytes,
                owned: bool = False) -> object:
        """Every case but the hot paths (`asynccache.cache.codec.general`)."""
        return decode_general(self._rules, data, key, owned)


DEFAULT_CODEC = Codec()
