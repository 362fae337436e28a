"""Tests for asynccache.cache.codec.codec: round trips, zero-copy buffers, compression, key binding,
damage detection and bounded decoding of hostile input."""

from __future__ import annotations

import json
import math
import pickle
import struct
import sys
import threading
import time
import tracemalloc
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import lz4.frame
import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynccache.cache.codec import compression as compression_module
from asynccache.cache.codec import pickling
from asynccache.cache.codec.codec import (
    DEFAULT_CODEC,
    HEADER_SIZE,
    MAGIC,
    MIN_CHUNK_SIZE,
    ChunkManifest,
    Codec,
    join_chunks,
    split_chunks,
)
from asynccache.errors import (
    CacheError,
    ConfigError,
    DecodeError,
    EncodeError,
    FormatMismatch,
    MissingDependency,
    ValueTooLarge,
)

F_COMP = 0b11
F_OOB = 0b100
F_MANIFEST = 0b1000
F_NOCHECK = 0b1_0000
F_MAC = 0b10_0000
F_NOPICKLE = 0b100_0000

KEY = b"ac:ns:42"
OTHER_KEYS = [b"ac:ns:43", b"ac:ns:4", b"ac:ns:420", b"ac:other:42", b""]
MISMATCH = "checksum mismatch: damaged, truncated, or written under another key"

CODECS = {
    "default": Codec(),
    "nocheck": Codec(checksum=False),
    "zstd": Codec(compression="zstd", compress_threshold=0),
    "lz4": Codec(compression="lz4", compress_threshold=0),
    "zstd-nocheck": Codec(compression="zstd", compress_threshold=0, checksum=False),
    "auto": Codec(compression="auto", compress_threshold=0),
    "protocol4": Codec(protocol=4),
}
all_codecs = pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))


def header(blob: bytes) -> tuple[bytes, int, int, int]:
    """(magic, version, flags, tag) of a blob."""
    magic, version, flags, tag = struct.unpack_from("<2sBBQ", blob)
    return magic, version, flags, tag


def seal(flags: int, payload: bytes, key: bytes = KEY, version: int = 2) -> bytes:
    """A blob built from the documented layout alone (not the codec's code): used to check
    the layout and to forge hostile input that passes the integrity check."""
    key_seed = xxhash.xxh3_64_intdigest(key, xxhash.xxh3_64_intdigest(bytes([version, flags])))
    tag = key_seed if flags & F_NOCHECK else xxhash.xxh3_64_intdigest(payload, key_seed)
    return MAGIC + bytes([version, flags]) + struct.pack("<Q", tag) + payload


def reseal(blob: bytes | bytearray, key: bytes = KEY) -> bytes:
    """Recompute the tag after editing a header byte, so only the edit itself is tested."""
    return seal(blob[3], bytes(blob[HEADER_SIZE:]), key, version=blob[2])


def same(a: object, b: object) -> bool:
    """Exact equality, arrays and tensors included (type, dtype, shape, values)."""
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


@dataclass
class Point:
    x: int
    y: float
    tags: list[str]


class Reenters:
    """An object whose pickling itself encodes a value (re-entrant codec use)."""

    def __reduce__(self) -> tuple[Any, ...]:
        inner = DEFAULT_CODEC.encode({"t": torch.ones(2)}, KEY)
        return (DEFAULT_CODEC.decode, (inner, KEY))


# --------------------------------------------------------------------------- round trips


NESTED = {
    "ints": [0, -1, 2**70, True],
    "floats": (0.0, -0.0, 1.5, math.inf),
    "text": "héllo ✓",
    "bytes": b"\x00\xff" * 10,
    "bytearray": bytearray(b"abc"),
    "set": {1, 2, 3},
    "frozen": frozenset({"a"}),
    "nested": [[[]], {"k": {"kk": (None,)}}],
    "ordered": OrderedDict(a=1, b=2),
    "point": Point(1, 2.5, ["x"]),
    "fraction": Fraction(1, 3),
    "complex": 1 + 2j,
    7: "int key",
    ("t", 1): "tuple key",
}


@all_codecs
def test_nested_roundtrip(codec: Codec) -> None:
    out = codec.decode(codec.encode(NESTED, KEY), KEY)
    assert out == NESTED
    assert type(out["ordered"]) is OrderedDict
    assert type(out["bytearray"]) is bytearray


def test_shared_references_are_preserved() -> None:
    shared = [1, 2]
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([shared, shared], KEY), KEY)
    assert out[0] is out[1]


FALSY = [None, 0, False, 0.0, b"", "", [], {}, (), set(), bytearray()]


@all_codecs
@pytest.mark.parametrize("value", FALSY, ids=repr)
def test_falsy_values_roundtrip_exactly(codec: Codec, value: object) -> None:
    out = codec.decode(codec.encode(value, KEY), KEY)
    assert type(out) is type(value)
    assert out == value
    if value is None or value is False:
        assert out is value


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
@pytest.mark.parametrize("value", [b"x" * 10, b"y" * 100_000], ids=["small", "large"])
def test_decode_accepts_bytes_like(kind: type, value: bytes) -> None:
    blob = DEFAULT_CODEC.encode(value, KEY)
    assert DEFAULT_CODEC.decode(kind(blob), KEY) == value


def test_decode_memoryview_slice_of_larger_buffer() -> None:
    blob = DEFAULT_CODEC.encode({"a": np.arange(10)}, KEY)
    framed = memoryview(b"junk" + blob + b"tail")[4 : 4 + len(blob)]
    assert np.array_equal(DEFAULT_CODEC.decode(framed, KEY)["a"], np.arange(10))


def test_decode_of_non_bytes_raises_decode_error() -> None:
    with pytest.raises(DecodeError):
        DEFAULT_CODEC.decode("\xacC not bytes", KEY)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", [Codec(), Codec(secret=b"s" * 32), Codec(compression="zstd"),
                                   Codec(protocol=4), Codec(checksum=False)],
                         ids=["default", "signed", "zstd", "protocol-4", "no-checksum"])
@pytest.mark.parametrize("size", [pickling.BIG_BYTES - 1, pickling.BIG_BYTES, 3 << 20])
def test_large_bytes_round_trip_and_are_plain_pickle(codec: Codec, size: int) -> None:
    """``bytes`` of BIG_BYTES or more are pickled without copying them into a stream
    first (`bytes_stream`): the same value back, as ``bytes``, from a payload that is an
    ordinary pickle stream (what every release unpickles)."""
    value = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    got = codec.decode(codec.encode(value, KEY), KEY)
    assert got == value and type(got) is bytes
    stream = b"".join(pickling.bytes_stream(value, 5))
    assert pickle.loads(stream) == value
    assert pickletools_ops(stream) == ["PROTO", "BINBYTES8", "STOP"]


def pickletools_ops(stream: bytes) -> list[str]:
    import pickletools

    return [op.name for op, _arg, _pos in pickletools.genops(stream)]


def test_encoding_large_bytes_holds_one_copy_of_them() -> None:
    """The encoded blob is the one copy: peak memory while encoding 16 MiB of ``bytes``
    stays near 16 MiB (``pickle.dumps`` and then the join held two)."""
    value = b"\x01" * (16 << 20)
    tracemalloc.start()
    try:
        blob = Codec().encode(value, KEY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(blob) > len(value)
    assert peak < 1.25 * len(value), peak


# --------------------------------------------------------------------------- numpy


NP_DTYPES = ["float32", "float64", "float16", "int8", "uint16", "int64", "bool", "complex128"]
NP_SHAPES = [(), (0,), (7,), (3, 4), (2, 3, 4), (0, 5)]


def _array(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    n = math.prod(shape)
    return (np.arange(n) % 5 + 1).astype(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", NP_DTYPES)
@pytest.mark.parametrize("shape", NP_SHAPES, ids=str)
def test_numpy_roundtrip_writable(dtype: str, shape: tuple[int, ...]) -> None:
    arr = _array(dtype, shape)
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(arr, KEY), KEY)
    assert type(out) is np.ndarray
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert np.array_equal(out, arr)
    assert out.flags.writeable
    if out.size:
        out.flat[0] = out.flat[-1]  # must not raise


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(24.0).reshape(4, 6)[:, ::2],  # non-contiguous view
        lambda: np.asfortranarray(np.arange(12).reshape(3, 4)),  # F-contiguous
        lambda: np.arange(10)[::-1],
        lambda: np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")]),
        lambda: np.array(["x", None, 3], dtype=object),
        lambda: np.datetime64("2024-01-01") + np.arange(3),
    ],
    ids=["strided", "fortran", "reversed", "structured", "object", "datetime"],
)
def test_numpy_layouts_roundtrip(make: Any) -> None:
    arr = make()
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(arr, KEY), KEY)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert np.array_equal(out, arr) if arr.dtype != object else list(out) == list(arr)
    assert out.flags.writeable


@pytest.fixture(params=["torch-imported", "numpy-only"])
def pickle_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through both encode paths: plain pickle.dumps when torch is not imported,
    the tensor-aware pickler when it is (asynccache itself imports torch when installed)."""
    if request.param == "numpy-only":
        monkeypatch.delitem(sys.modules, "torch")
    return str(request.param)


def test_readonly_numpy_array_decodes_writable(pickle_path: str) -> None:
    arr = np.arange(100.0)
    arr.flags.writeable = False
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(arr, KEY), KEY)
    assert out.flags.writeable
    out[0] = 42.0
    assert arr[0] == 0.0


@pytest.mark.parametrize("codec", [Codec(), Codec(compression="zstd", compress_threshold=0)])
def test_numpy_encode_is_out_of_band(codec: Codec, pickle_path: str) -> None:
    """The array bytes are not in the pickle stream: blob ~ nbytes + small overhead."""
    arr = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)  # incompressible
    blob = codec.encode(arr, KEY)
    _, _, flags, _ = header(blob)
    assert flags & F_OOB
    assert arr.nbytes < len(blob) < arr.nbytes + 300
    stream_len, nbuf = struct.unpack_from("<QI", blob, HEADER_SIZE)
    assert nbuf == 1 and stream_len < 300


def _stream(blob: bytes) -> bytes:
    """The pickle stream of an out-of-band value."""
    stream_len, nbuf = struct.unpack_from("<QI", blob, HEADER_SIZE)
    start = HEADER_SIZE + 12 + 8 * nbuf
    return blob[start : start + stream_len]


def _globals(stream: bytes) -> list[object]:
    """What a stream names to load: STACK_GLOBAL's strings, EXT codes."""
    import pickletools

    named: list[object] = []
    for op, arg, _ in pickletools.genops(stream):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE"):
            named.append(arg)
        elif op.name.startswith("EXT"):
            named.append(("ext", arg))
    return named


@pytest.mark.parametrize("dtype", [*NP_DTYPES, ">i4", "<u8", ">c8"])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3)], ids=str)
def test_plain_arrays_are_rebuilt_by_asynccache_not_numpy(
        dtype: str, shape: tuple[int, ...], pickle_path: str) -> None:
    """An array of a plain dtype pickles as (its buffer, dtype string, shape) under
    asynccache's extension code, not numpy's reduction (which rebuilds a dtype object
    from a pickled state on every load): half the load time of a small array. Byte
    order, dtype, shape and values come back exactly."""
    arr = _array(dtype, shape)
    blob = DEFAULT_CODEC.encode({"x": arr}, KEY)
    named = _globals(_stream(blob))
    assert ("ext", pickling.EXTENSION_CODES["rebuild_array"]) in named
    assert "numpy" not in named and "numpy._core.numeric" not in named
    out = DEFAULT_CODEC.decode(blob, KEY)["x"]
    assert type(out) is np.ndarray and out.dtype == arr.dtype and out.shape == arr.shape
    assert out.dtype.byteorder == arr.dtype.byteorder and np.array_equal(out, arr)
    assert out.flags.writeable


def test_values_naming_the_reconstructors_otherwise_still_decode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the stores hold from before, or from a process where another library had
    taken the extension codes, decodes alike: numpy's own reduction, and asynccache's
    reconstructors named by module and name."""
    import copyreg

    value = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "t": torch.arange(4)}
    with monkeypatch.context() as m:  # written before: numpy's own reduction
        m.setattr(pickling, "reduce_array", lambda a, protocol: NotImplemented)
        old = DEFAULT_CODEC.encode(value, KEY)
    assert "numpy" in _globals(_stream(old))
    for name, code in pickling.EXTENSION_CODES.items():
        copyreg.remove_extension(pickling.__name__, name, code)
    try:  # the codes taken by someone else: reconstructors pickled by name
        by_name = DEFAULT_CODEC.encode(value, KEY)
    finally:
        pickling._register_extensions()
    assert {"rebuild_array", "rebuild_tensor"} <= set(_globals(_stream(by_name)))
    for blob in (old, by_name, DEFAULT_CODEC.encode(value, KEY)):
        out = DEFAULT_CODEC.decode(blob, KEY)
        assert np.array_equal(out["a"], value["a"]) and out["a"].flags.writeable
        assert torch.equal(out["t"], value["t"])


def test_rebuild_array_from_readonly_or_bad_input() -> None:
    """The unpickle hook copies read-only buffers (the array must be writable) and
    refuses a dtype numpy does not know as a DecodeError."""
    out = pickling.rebuild_array(struct.pack("<2f", 1.0, 2.0), "<f4", (2,))
    assert out.flags.writeable and out.tolist() == [1.0, 2.0]
    with pytest.raises(DecodeError, match="dtype"):
        pickling.rebuild_array(bytearray(8), "not a dtype", (2,))


def _root(arr: np.ndarray) -> object:
    """The object at the end of an array's .base chain (the memory's owner)."""
    base: object = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def test_decoded_buffers_share_one_copy_not_the_input(pickle_path: str) -> None:
    value = {"a": np.arange(1000.0), "b": np.ones(500, dtype=np.int32)}
    blob = bytearray(DEFAULT_CODEC.encode(value, KEY))
    out = DEFAULT_CODEC.decode(blob, KEY)
    base_a, base_b = _root(out["a"]), _root(out["b"])
    assert isinstance(base_a, memoryview) and isinstance(base_b, memoryview)
    assert base_a.obj is base_b.obj  # one region copy serves every buffer
    assert base_a.obj is not blob  # ...and it is not the caller's buffer
    out["a"][:] = -1
    assert DEFAULT_CODEC.decode(blob, KEY)["a"][0] == 0.0


def test_buffers_are_aligned_for_their_dtype() -> None:
    """Odd-sized int8 buffers between float64 ones must not misalign the float64 data."""
    value = [a for n in range(1, 20) for a in (np.arange(n, dtype=np.int8), np.arange(n * 1.0))]
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(value, KEY), KEY)
    for a, b in zip(value, out, strict=True):
        assert np.array_equal(a, b)
        assert b.flags.aligned
        assert b.ctypes.data % 16 == 0


def test_trailing_bytes_after_buffers_are_rejected() -> None:
    codec = Codec(checksum=False)  # no payload checksum: the buffer table check must see it
    blob = codec.encode(np.arange(10), KEY)
    assert header(blob)[2] & F_OOB
    with pytest.raises(DecodeError, match="buffer sizes"):
        codec.decode(blob + b"\x00", KEY)


# --------------------------------------------------------------------------- torch


TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int64,
    torch.bool,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (0, 4), (2, 3, 4)], ids=str)
def test_torch_roundtrip_writable(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.arange(math.prod(shape)) % 3).to(dtype).reshape(shape)
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(t, KEY), KEY)
    assert type(out) is torch.Tensor
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)
    if out.numel():
        out.view(-1)[0] = out.view(-1)[-1]  # in-place write works, no warning


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),
        lambda: torch.arange(20)[::3],
        lambda: torch.arange(12.0).reshape(3, 4)[1:, 1:3],
        lambda: torch.complex(torch.ones(3), torch.arange(3.0)).conj(),
        lambda: torch.arange(4.0).expand(3, 4),
        lambda: torch.arange(1000.0)[10:20],
        lambda: torch._neg_view(torch.arange(3.0)),
    ],
    ids=["transposed", "stepped", "sliced", "conj", "expanded", "offset", "neg"],
)
def test_torch_views_roundtrip(make: Any) -> None:
    t = make()
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(t, KEY), KEY)
    assert torch.equal(out, t.resolve_conj())
    assert not out.is_conj()
    out.add_(1)


def test_a_contiguous_slice_stores_its_own_values_only() -> None:
    """Reduced as its memory as it is (no copy), a slice is still only its own bytes,
    not the storage it is a view of."""
    t = torch.arange(1_000_000, dtype=torch.float32)[500:510]
    blob = DEFAULT_CODEC.encode(t, KEY)
    assert len(blob) < 200
    assert torch.equal(DEFAULT_CODEC.decode(blob, KEY), t)


def test_rebuild_tensor_from_readonly_or_bad_input() -> None:
    """The unpickle hook copies read-only buffers (torch would warn) and rejects bad dtypes."""
    t = pickling.rebuild_tensor(struct.pack("<2f", 1.0, 2.0), "float32", (2,))
    assert torch.equal(t, torch.tensor([1.0, 2.0]))
    with pytest.raises(DecodeError, match="dtype"):
        pickling.rebuild_tensor(bytearray(8), "Tensor", (2,))


def test_torch_requires_grad_and_parameter_use_torch_pickling() -> None:
    t = torch.ones(3, requires_grad=True)
    p = torch.nn.Parameter(torch.zeros(2))
    out_t, out_p = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([t, p], KEY), KEY)
    assert out_t.requires_grad and torch.equal(out_t.detach(), t.detach())
    assert isinstance(out_p, torch.nn.Parameter)


def test_torch_encode_is_out_of_band() -> None:
    t = torch.rand(3, 128, 128)
    blob = DEFAULT_CODEC.encode({"image": t, "label": 3}, KEY)
    _, _, flags, _ = header(blob)
    assert flags & F_OOB
    nbytes = t.numel() * t.element_size()
    assert nbytes < len(blob) < nbytes + 400
    stream_len, nbuf = struct.unpack_from("<QI", blob, HEADER_SIZE)
    assert nbuf == 1 and stream_len < 400


def test_torch_tensors_decoded_twice_do_not_share_memory() -> None:
    blob = DEFAULT_CODEC.encode(torch.zeros(10), KEY)
    a, b = DEFAULT_CODEC.decode(blob, KEY), DEFAULT_CODEC.decode(blob, KEY)
    a += 1
    assert b.sum().item() == 0


def test_torch_same_tensor_twice_is_shared_after_decode() -> None:
    t = torch.arange(5)
    a, b = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([t, t], KEY), KEY)
    assert a is b


def test_encode_is_thread_safe_and_reentrant() -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(200):
                value = {"i": i, "j": j, "t": torch.full((4,), float(i * 1000 + j))}
                out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(value, KEY), KEY)
                assert out["i"] == i and out["j"] == j
                assert torch.equal(out["t"], value["t"])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([Reenters(), torch.arange(3)], KEY), KEY)
    assert torch.equal(out[0]["t"], torch.ones(2)) and torch.equal(out[1], torch.arange(3))


def test_encode_works_after_a_failed_encode() -> None:
    with pytest.raises(EncodeError):
        DEFAULT_CODEC.encode([torch.ones(1), lambda: 1], KEY)
    assert torch.equal(
        DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([torch.ones(1)], KEY), KEY)[0], torch.ones(1)
    )


# --------------------------------------------------------------------------- compression


COMPRESSIBLE = {"text": "the quick brown fox " * 5000, "arr": np.zeros(50_000, dtype=np.float32)}


@pytest.mark.parametrize("compression,bits", [("zstd", 1), ("lz4", 2), ("auto", 1)])
def test_compression_shrinks_compressible_values(compression: str, bits: int) -> None:
    plain = Codec().encode(COMPRESSIBLE, KEY)
    codec = Codec(compression=compression)
    blob = codec.encode(COMPRESSIBLE, KEY)
    assert header(blob)[2] & F_COMP == bits
    assert len(blob) < len(plain) // 10
    out = codec.decode(blob, KEY)
    assert out["text"] == COMPRESSIBLE["text"]
    assert np.array_equal(out["arr"], COMPRESSIBLE["arr"])
    out["arr"][0] = 1.0  # still writable after decompression
    assert Codec().decode(blob, KEY)["text"] == COMPRESSIBLE["text"]  # readable by any codec


@pytest.mark.parametrize("compression", ["zstd", "lz4", "auto"])
def test_incompressible_values_stay_uncompressed(compression: str) -> None:
    value = np.random.default_rng(1).bytes(100_000)
    blob = Codec(compression=compression).encode(value, KEY)
    assert header(blob)[2] & F_COMP == 0
    assert blob == Codec().encode(value, KEY)


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_values_below_threshold_are_not_compressed(compression: str) -> None:
    value = b"a" * 1000
    assert header(Codec(compression=compression).encode(value, KEY))[2] & F_COMP == 0
    small_threshold = Codec(compression=compression, compress_threshold=100)
    assert header(small_threshold.encode(value, KEY))[2] & F_COMP != 0


def test_compression_off_never_compresses() -> None:
    assert header(Codec(compress_threshold=0).encode(b"a" * 100_000, KEY))[2] & F_COMP == 0


def test_auto_falls_back_to_lz4_then_off(monkeypatch: pytest.MonkeyPatch) -> None:
    value = b"a" * 100_000
    monkeypatch.setitem(sys.modules, "zstandard", None)
    assert header(Codec(compression="auto").encode(value, KEY))[2] & F_COMP == 2
    monkeypatch.setitem(sys.modules, "lz4.frame", None)
    monkeypatch.setitem(sys.modules, "lz4", None)
    assert header(Codec(compression="auto").encode(value, KEY))[2] & F_COMP == 0


@pytest.mark.parametrize("compression,package", [("zstd", "zstandard"), ("lz4", "lz4")])
def test_missing_compressor(
    monkeypatch: pytest.MonkeyPatch, compression: str, package: str
) -> None:
    blob = Codec(compression=compression).encode(b"a" * 100_000, KEY)
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.setitem(sys.modules, "lz4.frame", None)
    with pytest.raises(MissingDependency, match=f"pip install {package}") as info:
        Codec(compression=compression)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ImportError)
    with pytest.raises(DecodeError, match=f"pip install {package}"):
        Codec().decode(blob, KEY)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"compression": "gzip"},
        {"compression": "zstd", "compress_level": 99},
        {"compress_level": "high"},
        {"compress_threshold": -1},
        {"compress_threshold": 1.5},
        {"protocol": 6},
        {"protocol": -1},
        {"max_value_bytes": 4095},
        {"max_value_bytes": 0},
        {"max_value_bytes": 1e9},
        {"max_value_bytes": None},
    ],
    ids=repr,
)
def test_invalid_config(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Codec(**kwargs)


# --------------------------------------------------------------------------- layout, keys


def test_blob_layout_matches_the_documented_format() -> None:
    """encode() writes exactly what the module docstring specifies."""
    value = {"a": 1}
    assert Codec().encode(value, KEY) == seal(0, pickle.dumps(value, 5))
    assert Codec(checksum=False).encode(value, KEY) == seal(F_NOCHECK, pickle.dumps(value, 5))
    assert HEADER_SIZE == 12


def sample_values() -> dict[str, tuple[Codec, object]]:
    """One value per payload kind, with a codec that writes it that way."""
    return {
        "plain": (Codec(), {"a": [1, 2.5, "x"], "b": b"\x00" * 10}),
        "large": (Codec(), b"L" * 5000),  # over the hot path's size
        "oob": (Codec(), [np.arange(6, dtype=np.int16), torch.arange(3)]),
        "zstd": (Codec(compression="zstd", compress_threshold=0), ["z"] * 30),
        "lz4": (Codec(compression="lz4", compress_threshold=0), ["l"] * 30),
        "falsy": (Codec(), None),
    }


MANIFEST = ChunkManifest(chunks=3, size=3000, chunk_size=1024, digest=1234, token="ab12")


def sample_blobs(checksum: bool = True, key: bytes = KEY) -> dict[str, bytes]:
    blobs = {}
    for name, (codec, value) in sample_values().items():
        config = {**codec._config(), "checksum": checksum}
        blobs[name] = Codec(**config).encode(value, key)
    blobs["manifest"] = Codec(checksum=checksum).encode_manifest(MANIFEST, key)
    return blobs


SAMPLES = sample_blobs()
samples = pytest.mark.parametrize("name", list(SAMPLES))


@samples
@pytest.mark.parametrize("checksum", [True, False], ids=["checksum", "nocheck"])
@pytest.mark.parametrize("other", OTHER_KEYS, ids=repr)
def test_decode_under_another_key_raises(name: str, checksum: bool, other: bytes) -> None:
    blob = sample_blobs(checksum)[name]
    codec = Codec(checksum=checksum)
    codec.decode(blob, KEY)  # precondition: it decodes under its own key
    with pytest.raises(DecodeError, match="another key"):
        codec.decode(blob, other)
    with pytest.raises(DecodeError, match="another key"):  # the general path, too
        codec.decode(bytearray(blob), other)


def test_swapped_blobs_of_two_keys_are_both_rejected() -> None:
    k1, k2 = b"ac:ns:1", b"ac:ns:2"
    for codec in CODECS.values():
        b1, b2 = codec.encode("one", k1), codec.encode("two", k2)
        with pytest.raises(DecodeError, match="another key"):
            codec.decode(b2, k1)
        with pytest.raises(DecodeError, match="another key"):
            codec.decode(b1, k2)


def test_chunked_value_is_bound_to_its_main_key() -> None:
    value = np.arange(10_000.0)
    blob = DEFAULT_CODEC.encode(value, KEY)
    manifest = DEFAULT_CODEC.decode(
        DEFAULT_CODEC.encode_manifest(ChunkManifest.for_blob(blob, 4096), KEY), KEY
    )
    assert isinstance(manifest, ChunkManifest)
    joined = join_chunks([bytes(p) for p in split_chunks(blob, 4096)], manifest)
    assert np.array_equal(DEFAULT_CODEC.decode(joined, KEY), value)
    with pytest.raises(DecodeError, match="another key"):
        DEFAULT_CODEC.decode(joined, b"ac:ns:43")


# --------------------------------------------------------------------------- damage


@samples
def test_every_flipped_byte_is_detected(name: str) -> None:
    blob = SAMPLES[name]
    assert not header(blob)[2] & F_NOCHECK  # precondition: a real checksum
    Codec().decode(blob, KEY)  # precondition: the intact blob decodes
    for pos in range(len(blob)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[pos] ^= mask
            with pytest.raises(DecodeError):
                Codec().decode(bytes(bad), KEY)


@samples
@pytest.mark.parametrize("checksum", [True, False], ids=["checksum", "nocheck"])
def test_every_truncation_is_detected(name: str, checksum: bool) -> None:
    blob = sample_blobs(checksum)[name]
    codec = Codec(checksum=checksum)
    codec.decode(blob, KEY)
    for n in range(len(blob)):
        with pytest.raises(DecodeError):
            codec.decode(blob[:n], KEY)


def test_checksum_off_blob_layout() -> None:
    blob = Codec(checksum=False).encode("v", KEY)
    assert header(blob)[2] & F_NOCHECK
    assert Codec(checksum=False).decode(blob, KEY) == "v"
    bad = blob[:4] + bytes(8) + blob[HEADER_SIZE:]
    with pytest.raises(DecodeError, match="another key"):
        Codec(checksum=False).decode(bad, KEY)


def test_checksum_true_refuses_unverified_values() -> None:
    """A checksum=True reader never accepts a payload nobody verified; a checksum=False
    reader accepts both kinds (and verifies the checksummed ones in full)."""
    unverified = Codec(checksum=False).encode("v", KEY)
    with pytest.raises(DecodeError, match="without a checksum"):
        Codec().decode(unverified, KEY)
    verified = Codec().encode("v", KEY)
    assert Codec(checksum=False).decode(verified, KEY) == "v"
    damaged = verified[:-2] + bytes([verified[-2] ^ 1]) + verified[-1:]
    with pytest.raises(DecodeError, match="checksum mismatch"):
        Codec(checksum=False).decode(damaged, KEY)


FOREIGN = [
    b"",
    b"\xac",
    b"\xacC",
    b"\xacC\x02",
    b"\xacC\x02\x00\x00\x00",
    b"hello",
    b"\x00" * 16,
    json.dumps({"a": [1, 2, None]}).encode(),
    b"$5\r\nhello\r\n",
    b"+OK\r\n",
    b"VALUE key 0 5\r\nhello\r\nEND\r\n",
    "ünïcode".encode(),
    *(pickle.dumps({"a": 1}, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)),
    pickle.dumps(None),
]


@pytest.mark.parametrize("data", FOREIGN, ids=repr)
def test_foreign_bytes_raise_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        Codec().decode(data, KEY)
    assert isinstance(info.value, CacheError)


def v1_blob(value: object, flags: int = 0) -> bytes:
    """A value in the previous release's layout: magic, version 1, flags, crc32."""
    stream = pickle.dumps(value, 5)
    return (
        MAGIC
        + bytes([1, flags])
        + struct.pack("<I", zlib.crc32(bytes([1, flags]) + stream))
        + stream
    )


@pytest.mark.parametrize(
    "blob",
    [v1_blob("x"), v1_blob("x" * 5000), v1_blob(None, F_NOCHECK), v1_blob(1, 0x80)],
    ids=["small", "large", "nocrc", "odd-flags"],
)
def test_v1_values_are_a_format_mismatch(blob: bytes) -> None:
    for codec in (Codec(), Codec(checksum=False)):
        with pytest.raises(FormatMismatch, match=r"version 1.*reads version 2"):
            codec.decode(blob, KEY)


@pytest.mark.parametrize("version", [0, 3, 255])
def test_other_versions_are_a_format_mismatch(version: int) -> None:
    blob = seal(0, pickle.dumps("x"), version=version)
    with pytest.raises(FormatMismatch, match=f"version {version}"):
        Codec().decode(blob, KEY)
    assert issubclass(FormatMismatch, DecodeError)


@pytest.mark.parametrize("flag", [F_MAC, F_MAC | F_NOPICKLE], ids=["mac", "both"])
def test_signed_flag_names_the_missing_secret(flag: int) -> None:
    blob = bytearray(Codec().encode("x", KEY))
    blob[3] |= flag
    for codec in (Codec(), Codec(checksum=False)):
        with pytest.raises(DecodeError, match="written by a Codec with a secret"):
            codec.decode(reseal(blob), KEY)


def test_pickle_stream_under_the_pickle_free_flag_is_never_unpickled() -> None:
    for value in ("x", "y" * 5000):  # hot-path size and general path
        blob = bytearray(Codec().encode(value, KEY))
        blob[3] |= F_NOPICKLE
        with pytest.raises(DecodeError, match="pickle-free"):
            Codec().decode(reseal(blob), KEY)


@pytest.mark.parametrize("flag", [0b11, 0b1000_0000], ids=["comp3", "bit7"])
def test_unknown_flags(flag: int) -> None:
    blob = bytearray(Codec().encode("x", KEY))
    blob[3] |= flag
    with pytest.raises(DecodeError, match="unknown"):
        Codec().decode(reseal(blob), KEY)


def test_invalid_flag_combinations() -> None:
    blob = bytearray(Codec().encode_manifest(MANIFEST, KEY))
    blob[3] |= 1  # a "compressed" manifest is never written
    with pytest.raises(DecodeError, match="manifest"):
        Codec().decode(reseal(blob), KEY)
    blob = bytearray(Codec().encode("plain", KEY))
    blob[3] |= F_OOB  # plain pickle is not an out-of-band payload
    with pytest.raises(DecodeError):
        Codec().decode(reseal(blob), KEY)


def test_corrupt_compressed_payload_with_valid_tag() -> None:
    blob = bytearray(Codec(compression="zstd", compress_threshold=0).encode(["z"] * 30, KEY))
    blob[-3] ^= 0xFF
    with pytest.raises(DecodeError, match="zstd"):
        Codec().decode(reseal(blob), KEY)


def test_unpicklable_payload_with_valid_tag() -> None:
    stream = pickle.dumps(Point(1, 2.0, []))
    stream = stream.replace(b"Point", b"Pnint")
    for blob in (seal(0, stream), seal(0, stream + bytes(3000))):  # hot and general path
        with pytest.raises(DecodeError, match="unpickle"):
            Codec().decode(blob, KEY)


# --------------------------------------------------------------------------- hostile input


SMALL_BOUND = 8 << 20  # max_value_bytes of the bomb tests: keeps them cheap


def decode_hostile(codec: Codec, blob: bytes) -> tuple[DecodeError, int, float]:
    """Decode ``blob``, which must fail: (the DecodeError, peak traced bytes, seconds)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(DecodeError) as info:
            codec.decode(blob, KEY)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return info.value, peak, elapsed


def lz4_bomb(blocks: int, declared: int | None) -> bytes:
    """An lz4 frame of ``blocks`` independent 4 MiB blocks of zeros (~16 KiB each), whose
    header records ``declared`` as the content size (None: records none)."""
    one = lz4.frame.compress(
        bytes(4 << 20), block_size=lz4.frame.BLOCKSIZE_MAX4MB, block_linked=False, store_size=False
    )
    block = one[7:-4]  # after magic, FLG, BD, HC; before the end mark
    flg = 0x60 | (0x08 if declared is not None else 0)  # v1, independent blocks, +content size
    desc = bytes([flg, 0x70]) + (b"" if declared is None else struct.pack("<Q", declared))
    checksum = (xxhash.xxh32_intdigest(desc) >> 8) & 0xFF
    return struct.pack("<I", 0x184D2204) + desc + bytes([checksum]) + block * blocks + bytes(4)


def zstd_bomb(blocks: int, declared: int | None) -> bytes:
    """A zstd frame (RFC 8878) of ``blocks`` RLE blocks of 128 KiB zeros, 4 bytes each,
    whose header records ``declared`` as the content size (None: records none)."""
    descriptor = 0xC0 if declared is not None else 0x00  # 8-byte content size or none
    head = struct.pack("<I", 0xFD2FB528) + bytes([descriptor, 7 << 3])  # window 2**17
    if declared is not None:
        head += struct.pack("<Q", declared)
    rle = (128 << 10) << 3 | 1 << 1  # block size, type 1 (RLE), not last
    body = (rle.to_bytes(3, "little") + b"\0") * (blocks - 1)
    return head + body + (rle | 1).to_bytes(3, "little") + b"\0"


def test_bomb_builders_make_valid_frames() -> None:
    """The hand-built frames are what they claim (small versions, fully decompressed)."""
    assert lz4.frame.decompress(lz4_bomb(2, 8 << 20)) == bytes(8 << 20)
    assert zstandard.ZstdDecompressor().decompress(zstd_bomb(3, 3 << 17)) == bytes(3 << 17)


@pytest.mark.parametrize("kind,bits,build", [("lz4", 2, lz4_bomb), ("zstd", 1, zstd_bomb)])
@pytest.mark.parametrize(
    "declared", ["none", "true", "payload-bound", "small"], ids=lambda d: f"records-{d}"
)
def test_decompression_bomb_is_refused_in_bounded_memory(
    kind: str, bits: int, build: Callable[[int, int | None], bytes], declared: str
) -> None:
    """A ~4 MB frame that expands to 1 GiB (lz4) / 128 GiB (zstd), wrapped in a valid v2
    header with a correct tag: refused having allocated at most ~max_value_bytes (traced
    by tracemalloc, which sees both libraries' buffers: they come from PyMem / PyBytes)."""
    blocks = 256 if kind == "lz4" else 1_000_000
    expanded = blocks * (4 << 20 if kind == "lz4" else 128 << 10)
    sizes = {"none": None, "true": expanded, "payload-bound": SMALL_BOUND - 12, "small": 1 << 20}
    frame = build(blocks, sizes[declared])
    assert 3_900_000 < len(frame) < 4_300_000 and expanded > 100 * SMALL_BOUND
    codec = Codec(max_value_bytes=SMALL_BOUND)
    exc, peak, elapsed = decode_hostile(codec, seal(bits, frame))
    assert kind in str(exc)
    if declared == "true":
        assert "max_value_bytes" in str(exc)
    # python-lz4 copies its output buffer into the returned bytes: twice the size at peak.
    assert peak < (2 if kind == "lz4" else 1) * SMALL_BOUND + (1 << 20)
    assert elapsed < 1.0


def test_legitimate_compressed_value_over_the_readers_bound() -> None:
    """A peer with a larger bound wrote it: refused before decompressing, naming the bound."""
    for compression in ("zstd", "lz4"):
        blob = Codec(compression=compression).encode(b"a" * 100_000, KEY)
        assert len(blob) < 4096
        with pytest.raises(DecodeError, match="max_value_bytes"):
            Codec(max_value_bytes=4096).decode(blob, KEY)


def test_compressed_frame_without_recorded_size_is_refused() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 1000)
    with pytest.raises(DecodeError, match="does not record"):
        Codec().decode(seal(1, frame), KEY)
    frame = lz4.frame.compress(pickle.dumps("x" * 1000), store_size=False)
    with pytest.raises(DecodeError, match="does not record"):
        Codec().decode(seal(2, frame), KEY)


@pytest.mark.parametrize("kind,bits", [("lz4", 2), ("zstd", 1)])
def test_compressed_frame_with_trailing_bytes_is_refused(kind: str, bits: int) -> None:
    frame = compression_module.compress(kind, pickle.dumps("x" * 1000), None)
    with pytest.raises(DecodeError, match=kind):
        Codec().decode(seal(bits, frame + b"junk"), KEY)


def manifest_payload(chunks: int, size: int, chunk_size: int, token: bytes = b"t") -> bytes:
    return struct.pack("<QQQQB", chunks, size, chunk_size, 0, len(token)) + token


@pytest.mark.parametrize(
    "payload,match",
    [
        (manifest_payload(4_000_000, 4_000_000 * 1024, 1024), "max_value_bytes"),
        (manifest_payload(4_000_000, 4_000_000 * 64, 64), "MIN_CHUNK_SIZE"),
        (manifest_payload(1, 100 * 10**9, 100 * 10**9), "max_value_bytes"),
        (manifest_payload(4_000_000, 4096, 1024), "make 4"),
        (manifest_payload(2**64 - 1, 2**64 - 1, 2**64 - 1), "max_value_bytes"),
        (manifest_payload(1, 1024, 1024)[:-1], "length"),
    ],
    ids=["4M-chunks", "4M-tiny-chunks", "100GB", "inconsistent", "u64-max", "truncated"],
)
def test_forged_manifest_is_refused_before_anything_is_allocated(
    payload: bytes, match: str
) -> None:
    exc, peak, elapsed = decode_hostile(Codec(), seal(F_MANIFEST, payload))
    assert match in str(exc)
    assert peak < 64 << 10
    assert elapsed < 0.1  # work in proportion to the claim would take seconds


@pytest.mark.parametrize(
    "table,match",
    [
        (struct.pack("<QI", 10, 2**31), "claims 2147483648 buffers"),
        (struct.pack("<QI", 10, 2**32 - 1), "buffers"),
        (struct.pack("<QIQ", 2**63, 1, 4), "truncated"),
        (struct.pack("<QIQ", 0, 1, 2**62), "buffer sizes"),
    ],
    ids=["2**31-buffers", "u32-max-buffers", "huge-stream", "huge-buffer"],
)
def test_forged_buffer_table_is_refused_fast(table: bytes, match: str) -> None:
    for payload in (table + bytes(16), table + bytes(5000)):  # bytes slice / memoryview
        exc, peak, elapsed = decode_hostile(Codec(), seal(F_OOB, payload))
        assert match in str(exc)
        assert peak < 64 << 10
        assert elapsed < 0.1


def test_value_too_large_on_encode() -> None:
    codec = Codec(max_value_bytes=4096)
    with pytest.raises(ValueTooLarge, match=r"over max_value_bytes=4096; raise max_value_bytes"):
        codec.encode(b"x" * 5000, KEY)
    with pytest.raises(ValueTooLarge, match="bytes encoded"):
        codec.encode(np.zeros(1000), KEY)  # out-of-band path
    with pytest.raises(ValueTooLarge):  # the bound is before compression: readers decompress
        Codec(compression="zstd", max_value_bytes=4096).encode(b"a" * 5000, KEY)
    with pytest.raises(ValueTooLarge):
        codec.encode_manifest(ChunkManifest.for_blob(bytes(5000), 1024), KEY)
    assert issubclass(ValueTooLarge, EncodeError)


def test_value_exactly_at_the_bound_is_written_and_read() -> None:
    codec = Codec(max_value_bytes=4096)
    fits = max(n for n in range(3900, 4096) if len(Codec().encode(b"x" * n, KEY)) <= 4096)
    blob = codec.encode(b"x" * fits, KEY)
    assert len(blob) == 4096 and codec.decode(blob, KEY) == b"x" * fits
    with pytest.raises(ValueTooLarge):
        codec.encode(b"x" * (fits + 1), KEY)
    with pytest.raises(DecodeError, match="max_value_bytes=4096"):  # from a larger-bound peer
        codec.decode(Codec().encode(b"x" * (fits + 1), KEY), KEY)


# --------------------------------------------------------------------------- encode errors


def _generator() -> Any:
    yield 1


@pytest.mark.parametrize(
    "value",
    [lambda: 1, threading.Lock(), _generator(), {"nested": [threading.Lock()]}],
    ids=["lambda", "lock", "generator", "nested-lock"],
)
@pytest.mark.parametrize("torch_path", [False, True], ids=["plain", "tensor-pickler"])
def test_unpicklable_values_raise_encode_error(value: object, torch_path: bool) -> None:
    obj: object = [torch.ones(1), value] if torch_path else value
    with pytest.raises(EncodeError, match="picklable") as info:
        Codec().encode(obj, KEY)
    assert type(obj).__qualname__ in str(info.value)
    assert "codec" in str(info.value)
    assert info.value.__cause__ is not None


def test_local_class_instance_raises_encode_error() -> None:
    class Local:
        pass

    with pytest.raises(EncodeError, match="Local"):
        Codec().encode(Local(), KEY)


def test_manifest_is_not_a_cacheable_value() -> None:
    with pytest.raises(EncodeError, match="encode_manifest"):
        Codec().encode(MANIFEST, KEY)
    with pytest.raises(EncodeError):
        Codec().encode_manifest("not a manifest", KEY)  # type: ignore[arg-type]
    with pytest.raises(EncodeError, match="MIN_CHUNK_SIZE"):  # readers would refuse it
        Codec().encode_manifest(ChunkManifest.for_blob(bytes(100), 7), KEY)


# --------------------------------------------------------------------------- manifests


@all_codecs
def test_manifest_roundtrip(codec: Codec) -> None:
    size = 2**28 - 5
    manifest = ChunkManifest(
        chunks=-(-size // 4096),
        size=size,
        chunk_size=4096,
        digest=2**64 - 1,
        token="tök-" + "9" * 40,
    )
    blob = codec.encode_manifest(manifest, KEY)
    assert header(blob)[2] & F_MANIFEST and header(blob)[2] & F_COMP == 0
    out = codec.decode(blob, KEY)
    assert type(out) is ChunkManifest and out == manifest
    assert Codec(checksum=False).decode(blob, KEY) == manifest


@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 1000])
@pytest.mark.parametrize("chunk_size", [1, 7, 100, 5000])
def test_split_join_roundtrip(size: int, chunk_size: int) -> None:
    blob = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    parts = split_chunks(blob, chunk_size)
    manifest = ChunkManifest.for_blob(blob, chunk_size)
    assert manifest.chunks == len(parts) == math.ceil(size / chunk_size)
    assert manifest.chunk_size == chunk_size and manifest.digest == xxhash.xxh3_64_intdigest(blob)
    assert all(len(p) <= chunk_size for p in parts)
    assert join_chunks([bytes(p) for p in parts], manifest) == blob


def test_split_chunks_is_zero_copy_and_tokens_are_fresh() -> None:
    blob = b"x" * 1000
    parts = split_chunks(blob, 300)
    assert all(isinstance(p, memoryview) and p.obj is blob for p in parts)
    assert ChunkManifest.for_blob(blob, 300).token != ChunkManifest.for_blob(blob, 300).token


def test_big_value_through_chunks_end_to_end() -> None:
    value = {"img": torch.rand(3, 64, 64), "label": 1}
    blob = DEFAULT_CODEC.encode(value, KEY)
    parts = [bytes(p) for p in split_chunks(blob, 4096)]
    manifest = DEFAULT_CODEC.decode(
        DEFAULT_CODEC.encode_manifest(ChunkManifest.for_blob(blob, 4096), KEY), KEY
    )
    assert isinstance(manifest, ChunkManifest)
    out = DEFAULT_CODEC.decode(join_chunks(parts, manifest), KEY)
    assert torch.equal(out["img"], value["img"])


def test_join_chunks_detects_mismatches() -> None:
    blob = bytes(range(200))
    parts = [bytes(p) for p in split_chunks(blob, 64)]
    manifest = ChunkManifest.for_blob(blob, 64)
    with pytest.raises(DecodeError, match="chunks"):
        join_chunks(parts[:-1], manifest)
    with pytest.raises(DecodeError, match="chunks"):
        join_chunks([*parts, b""], manifest)
    with pytest.raises(DecodeError, match="bytes"):
        join_chunks([*parts[:-1], parts[-1] + b"!"], manifest)
    stale = bytearray(parts[1])
    stale[0] ^= 1
    with pytest.raises(DecodeError, match="checksum"):
        join_chunks([parts[0], bytes(stale), *parts[2:]], manifest)
    with pytest.raises(DecodeError, match="checksum"):
        join_chunks([parts[1], parts[0], *parts[2:]], manifest)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunks": -1, "size": 0, "chunk_size": 1, "digest": 0, "token": "t"},
        {"chunks": 1, "size": -1, "chunk_size": 1, "digest": 0, "token": "t"},
        {"chunks": 1, "size": 1, "chunk_size": 0, "digest": 0, "token": "t"},
        {"chunks": 1, "size": 1, "chunk_size": 1.0, "digest": 0, "token": "t"},
        {"chunks": 2, "size": 1024, "chunk_size": 1024, "digest": 0, "token": "t"},
        {"chunks": 0, "size": 1, "chunk_size": 1024, "digest": 0, "token": "t"},
        {"chunks": 1, "size": 1, "chunk_size": 1, "digest": 2**64, "token": "t"},
        {"chunks": 1, "size": 1, "chunk_size": 1, "digest": 0, "token": ""},
        {"chunks": 1, "size": 1, "chunk_size": 1, "digest": 0, "token": "x" * 256},
        {"chunks": True, "size": 1, "chunk_size": 1, "digest": 0, "token": "t"},
    ],
    ids=repr,
)
def test_invalid_manifest(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ChunkManifest(**kwargs)


@pytest.mark.parametrize("chunk_size", [0, -5, 1.5])
def test_invalid_chunk_size(chunk_size: Any) -> None:
    with pytest.raises(ConfigError):
        split_chunks(b"abc", chunk_size)
    with pytest.raises(ConfigError):
        ChunkManifest.for_blob(b"abc", chunk_size)


def test_largest_manifest_at_the_bounds_is_accepted() -> None:
    """size == max_value_bytes in MIN_CHUNK_SIZE chunks: the most chunks a reader requests."""
    codec = Codec()
    size = codec.max_value_bytes
    widest = ChunkManifest(size // MIN_CHUNK_SIZE, size, MIN_CHUNK_SIZE, 0, "t")
    assert widest.chunks == 262_144
    assert codec.decode(codec.encode_manifest(widest, KEY), KEY) == widest
    narrower = manifest_payload(-(-size // (MIN_CHUNK_SIZE - 1)), size, MIN_CHUNK_SIZE - 1)
    with pytest.raises(DecodeError, match="MIN_CHUNK_SIZE"):
        codec.decode(seal(F_MANIFEST, narrower), KEY)
    over = manifest_payload(size // MIN_CHUNK_SIZE + 1, size + 1, MIN_CHUNK_SIZE)
    with pytest.raises(DecodeError, match="max_value_bytes"):
        codec.decode(seal(F_MANIFEST, over), KEY)


# --------------------------------------------------------------------------- codec object


@all_codecs
def test_codec_pickles_and_compares(codec: Codec) -> None:
    clone = pickle.loads(pickle.dumps(codec))
    assert clone == codec and hash(clone) == hash(codec)
    assert clone.decode(codec.encode(NESTED, KEY), KEY) == NESTED
    assert repr(clone) == repr(codec)
    assert f"compression={codec.compression!r}" in repr(codec)


def test_codec_equality() -> None:
    assert Codec() == DEFAULT_CODEC
    assert Codec(compression="zstd") != Codec(compression="lz4")
    assert Codec(checksum=False) != Codec()
    assert Codec(max_value_bytes=1 << 20) != Codec()
    assert Codec() != "Codec()"
    clone = pickle.loads(pickle.dumps(Codec(max_value_bytes=1 << 20)))
    assert clone.max_value_bytes == 1 << 20 and "max_value_bytes=1048576" in repr(clone)


# --------------------------------------------------------------------------- properties


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)


def containers(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """Lists, tuples and dicts of ``children`` (a named function: hypothesis inspects
    whether ``extend`` uses its argument, and its source lookup of lambdas can fail)."""
    return (
        st.lists(children, max_size=5)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5) | st.integers(), children, max_size=5)
    )


values = st.recursive(scalars, containers, max_leaves=25)
# Values that take the other payload kinds: compressible (zstd/lz4 codecs), out-of-band.
kinds = (
    values
    | st.text(alphabet="ab", min_size=200, max_size=3000)
    | st.builds(lambda n: np.arange(n, dtype=np.int32), st.integers(0, 600))
    | st.builds(lambda n: torch.arange(n), st.integers(0, 600))
)
keys = st.binary(max_size=64)
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HOSTILE = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VERIFYING = [CODECS[name] for name in ("default", "zstd", "lz4", "protocol4")]


@PROPS
@given(value=values, key=keys)
def test_property_roundtrip_every_codec(value: object, key: bytes) -> None:
    for codec in CODECS.values():
        assert codec.decode(codec.encode(value, key), key) == value


def mutate(blob: bytes, data: st.DataObject) -> bytes:
    """1-4 edits of ``blob``: bit flips, byte rewrites, truncation, insertion, deletion,
    appended bytes (positions anywhere, header included)."""
    out = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "delete", "append"]))
        pos = data.draw(st.integers(0, max(len(out) - 1, 0)), label="pos")
        if op == "flip" and out:
            out[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif op == "set" and out:
            out[pos] = data.draw(st.integers(0, 255), label="byte")
        elif op == "cut":
            del out[pos:]
        elif op == "insert":
            out[pos:pos] = data.draw(st.binary(min_size=1, max_size=8), label="inserted")
        elif op == "delete":
            del out[pos : pos + data.draw(st.integers(1, 8), label="deleted")]
        elif op == "append":
            out += data.draw(st.binary(min_size=1, max_size=16), label="appended")
    return bytes(out)


def _hostile_header() -> st.SearchStrategy[bytes]:
    """Bytes that get past the magic (and often the version): the parser's input space."""
    version = st.sampled_from([1, 2, 2, 2, 3])
    flags = st.integers(0, 255)
    return st.builds(
        lambda v, f, rest: MAGIC + bytes([v, f]) + rest, version, flags, st.binary(max_size=300)
    )


def test_property_any_bytes_are_a_decode_error(record_property: Any) -> None:
    """Arbitrary input, under any key and codec: DecodeError, never another exception."""
    count = 0

    @HOSTILE
    @given(data=st.binary(max_size=300) | _hostile_header(), key=keys)
    def check(data: bytes, key: bytes) -> None:
        nonlocal count
        count += 1
        for codec in CODECS.values():
            with pytest.raises(DecodeError):
                codec.decode(data, key)
            with pytest.raises(DecodeError):
                codec.decode(memoryview(data), key)

    check()
    record_property("hypothesis_examples", count)
    print(f"any-bytes property: {count} examples")
    assert count >= HOSTILE.max_examples


def test_property_mutated_blob_is_its_value_or_a_decode_error(record_property: Any) -> None:
    """Any mutation of a valid blob decodes, under its key, to exactly the value or raises
    DecodeError; under any other key it always raises. Never another exception type."""
    count = 0

    @HOSTILE
    @given(value=kinds, key=keys, other=keys, data=st.data())
    def check(value: object, key: bytes, other: bytes, data: st.DataObject) -> None:
        nonlocal count
        count += 1
        codec = data.draw(st.sampled_from(VERIFYING), label="codec")
        blob = mutate(codec.encode(value, key), data)
        try:
            out = codec.decode(blob, key)
        except DecodeError:
            pass
        else:
            assert same(value, out)
        if other != key:
            with pytest.raises(DecodeError):
                codec.decode(blob, other)

    check()
    record_property("hypothesis_examples", count)
    print(f"mutation property: {count} examples")
    assert count >= HOSTILE.max_examples


@PROPS
@given(value=kinds, key=keys, other=keys, data=st.data())
def test_property_nocheck_still_binds_key_and_detects_truncation(
    value: object, key: bytes, other: bytes, data: st.DataObject
) -> None:
    """checksum=False leaves payload edits undetected by design, but truncation and the
    key binding are still caught."""
    codec = data.draw(st.sampled_from([CODECS["nocheck"], CODECS["zstd-nocheck"]]))
    blob = codec.encode(value, key)
    with pytest.raises(DecodeError):
        codec.decode(blob[: data.draw(st.integers(0, len(blob) - 1))], key)
    if other != key:
        with pytest.raises(DecodeError, match="another key"):
            codec.decode(blob, other)
