"""Tests for asynccache.codec: round trips, zero-copy buffers, compression, damage detection."""

from __future__ import annotations

import json
import math
import pickle
import struct
import sys
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynccache.codec as codec_module
from asynccache.codec import (
    DEFAULT_CODEC,
    HEADER_SIZE,
    MAGIC,
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
    MissingDependency,
)

F_COMP = 0b11
F_OOB = 0b100
F_MANIFEST = 0b1000
F_NOCRC = 0b1_0000

CODECS = {
    "default": Codec(),
    "nocrc": Codec(checksum=False),
    "zstd": Codec(compression="zstd", compress_threshold=0),
    "lz4": Codec(compression="lz4", compress_threshold=0),
    "zstd-nocrc": Codec(compression="zstd", compress_threshold=0, checksum=False),
    "auto": Codec(compression="auto", compress_threshold=0),
    "protocol4": Codec(protocol=4),
}
all_codecs = pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))


def header(blob: bytes) -> tuple[bytes, int, int, int]:
    """(magic, version, flags, crc) of a blob."""
    magic, version, flags, crc = struct.unpack_from("<2sBBI", blob)
    return magic, version, flags, crc


def reseal(blob: bytes | bytearray) -> bytes:
    """Recompute the crc after editing a header byte, so only the edit itself is tested."""
    blob = bytes(blob)
    crc = zlib.crc32(blob[2:4] + blob[HEADER_SIZE:])
    return blob[:4] + struct.pack("<I", crc) + blob[HEADER_SIZE:]


@dataclass
class Point:
    x: int
    y: float
    tags: list[str]


class Reenters:
    """An object whose pickling itself encodes a value (re-entrant codec use)."""

    def __reduce__(self) -> tuple[Any, ...]:
        inner = DEFAULT_CODEC.encode({"t": torch.ones(2)})
        return (DEFAULT_CODEC.decode, (inner,))


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
    out = codec.decode(codec.encode(NESTED))
    assert out == NESTED
    assert type(out["ordered"]) is OrderedDict
    assert type(out["bytearray"]) is bytearray


def test_shared_references_are_preserved() -> None:
    shared = [1, 2]
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([shared, shared]))
    assert out[0] is out[1]


FALSY = [None, 0, False, 0.0, b"", "", [], {}, (), set(), bytearray()]


@all_codecs
@pytest.mark.parametrize("value", FALSY, ids=repr)
def test_falsy_values_roundtrip_exactly(codec: Codec, value: object) -> None:
    out = codec.decode(codec.encode(value))
    assert type(out) is type(value)
    assert out == value
    if value is None or value is False:
        assert out is value


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
@pytest.mark.parametrize("value", [b"x" * 10, b"y" * 100_000], ids=["small", "large"])
def test_decode_accepts_bytes_like(kind: type, value: bytes) -> None:
    blob = DEFAULT_CODEC.encode(value)
    assert DEFAULT_CODEC.decode(kind(blob)) == value


def test_decode_memoryview_slice_of_larger_buffer() -> None:
    blob = DEFAULT_CODEC.encode({"a": np.arange(10)})
    framed = memoryview(b"junk" + blob + b"tail")[4 : 4 + len(blob)]
    assert np.array_equal(DEFAULT_CODEC.decode(framed)["a"], np.arange(10))


def test_decode_of_non_bytes_raises_decode_error() -> None:
    with pytest.raises(DecodeError):
        DEFAULT_CODEC.decode("\xacC not bytes")  # type: ignore[arg-type]


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
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(arr))
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
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(arr))
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
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(arr))
    assert out.flags.writeable
    out[0] = 42.0
    assert arr[0] == 0.0


@pytest.mark.parametrize("codec", [Codec(), Codec(compression="zstd", compress_threshold=0)])
def test_numpy_encode_is_out_of_band(codec: Codec, pickle_path: str) -> None:
    """The array bytes are not in the pickle stream: blob ~ nbytes + small overhead."""
    arr = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)  # incompressible
    blob = codec.encode(arr)
    _, _, flags, _ = header(blob)
    assert flags & F_OOB
    assert arr.nbytes < len(blob) < arr.nbytes + 300
    stream_len, nbuf = struct.unpack_from("<QI", blob, HEADER_SIZE)
    assert nbuf == 1 and stream_len < 300


def _root(arr: np.ndarray) -> object:
    """The object at the end of an array's .base chain (the memory's owner)."""
    base: object = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def test_decoded_buffers_share_one_copy_not_the_input(pickle_path: str) -> None:
    value = {"a": np.arange(1000.0), "b": np.ones(500, dtype=np.int32)}
    blob = bytearray(DEFAULT_CODEC.encode(value))
    out = DEFAULT_CODEC.decode(blob)
    base_a, base_b = _root(out["a"]), _root(out["b"])
    assert isinstance(base_a, memoryview) and isinstance(base_b, memoryview)
    assert base_a.obj is base_b.obj  # one region copy serves every buffer
    assert base_a.obj is not blob  # ...and it is not the caller's buffer
    out["a"][:] = -1
    assert DEFAULT_CODEC.decode(blob)["a"][0] == 0.0


def test_buffers_are_aligned_for_their_dtype() -> None:
    """Odd-sized int8 buffers between float64 ones must not misalign the float64 data."""
    value = [a for n in range(1, 20) for a in (np.arange(n, dtype=np.int8), np.arange(n * 1.0))]
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(value))
    for a, b in zip(value, out, strict=True):
        assert np.array_equal(a, b)
        assert b.flags.aligned
        assert b.ctypes.data % 16 == 0


def test_trailing_bytes_after_buffers_are_rejected() -> None:
    blob = Codec(checksum=False).encode(np.arange(10))
    assert header(blob)[2] & F_OOB
    with pytest.raises(DecodeError):
        Codec().decode(blob + b"\x00")


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
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(t))
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
    ],
    ids=["transposed", "stepped", "sliced", "conj", "expanded"],
)
def test_torch_views_roundtrip(make: Any) -> None:
    t = make()
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(t))
    assert torch.equal(out, t.resolve_conj())
    assert not out.is_conj()
    out.add_(1)


def test_rebuild_tensor_from_readonly_or_bad_input() -> None:
    """The unpickle hook copies read-only buffers (torch would warn) and rejects bad dtypes."""
    t = codec_module._rebuild_tensor(struct.pack("<2f", 1.0, 2.0), "float32", (2,))
    assert torch.equal(t, torch.tensor([1.0, 2.0]))
    with pytest.raises(DecodeError, match="dtype"):
        codec_module._rebuild_tensor(bytearray(8), "Tensor", (2,))


def test_torch_requires_grad_and_parameter_use_torch_pickling() -> None:
    t = torch.ones(3, requires_grad=True)
    p = torch.nn.Parameter(torch.zeros(2))
    out_t, out_p = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([t, p]))
    assert out_t.requires_grad and torch.equal(out_t.detach(), t.detach())
    assert isinstance(out_p, torch.nn.Parameter)


def test_torch_encode_is_out_of_band() -> None:
    t = torch.rand(3, 128, 128)
    blob = DEFAULT_CODEC.encode({"image": t, "label": 3})
    _, _, flags, _ = header(blob)
    assert flags & F_OOB
    nbytes = t.numel() * t.element_size()
    assert nbytes < len(blob) < nbytes + 400
    stream_len, nbuf = struct.unpack_from("<QI", blob, HEADER_SIZE)
    assert nbuf == 1 and stream_len < 400


def test_torch_tensors_decoded_twice_do_not_share_memory() -> None:
    blob = DEFAULT_CODEC.encode(torch.zeros(10))
    a, b = DEFAULT_CODEC.decode(blob), DEFAULT_CODEC.decode(blob)
    a += 1
    assert b.sum().item() == 0


def test_torch_same_tensor_twice_is_shared_after_decode() -> None:
    t = torch.arange(5)
    a, b = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([t, t]))
    assert a is b


def test_encode_is_thread_safe_and_reentrant() -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(200):
                value = {"i": i, "j": j, "t": torch.full((4,), float(i * 1000 + j))}
                out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(value))
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
    out = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([Reenters(), torch.arange(3)]))
    assert torch.equal(out[0]["t"], torch.ones(2)) and torch.equal(out[1], torch.arange(3))


def test_encode_works_after_a_failed_encode() -> None:
    with pytest.raises(EncodeError):
        DEFAULT_CODEC.encode([torch.ones(1), lambda: 1])
    assert torch.equal(
        DEFAULT_CODEC.decode(DEFAULT_CODEC.encode([torch.ones(1)]))[0], torch.ones(1)
    )


# --------------------------------------------------------------------------- compression


COMPRESSIBLE = {"text": "the quick brown fox " * 5000, "arr": np.zeros(50_000, dtype=np.float32)}


@pytest.mark.parametrize("compression,bits", [("zstd", 1), ("lz4", 2), ("auto", 1)])
def test_compression_shrinks_compressible_values(compression: str, bits: int) -> None:
    plain = Codec().encode(COMPRESSIBLE)
    codec = Codec(compression=compression)
    blob = codec.encode(COMPRESSIBLE)
    assert header(blob)[2] & F_COMP == bits
    assert len(blob) < len(plain) // 10
    out = codec.decode(blob)
    assert out["text"] == COMPRESSIBLE["text"]
    assert np.array_equal(out["arr"], COMPRESSIBLE["arr"])
    out["arr"][0] = 1.0  # still writable after decompression
    assert Codec().decode(blob)["text"] == COMPRESSIBLE["text"]  # readable by any codec


@pytest.mark.parametrize("compression", ["zstd", "lz4", "auto"])
def test_incompressible_values_stay_uncompressed(compression: str) -> None:
    value = np.random.default_rng(1).bytes(100_000)
    blob = Codec(compression=compression).encode(value)
    assert header(blob)[2] & F_COMP == 0
    assert blob == Codec().encode(value)


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_values_below_threshold_are_not_compressed(compression: str) -> None:
    value = b"a" * 1000
    assert header(Codec(compression=compression).encode(value))[2] & F_COMP == 0
    small_threshold = Codec(compression=compression, compress_threshold=100)
    assert header(small_threshold.encode(value))[2] & F_COMP != 0


def test_compression_off_never_compresses() -> None:
    assert header(Codec(compress_threshold=0).encode(b"a" * 100_000))[2] & F_COMP == 0


def test_auto_falls_back_to_lz4_then_off(monkeypatch: pytest.MonkeyPatch) -> None:
    value = b"a" * 100_000
    monkeypatch.setitem(sys.modules, "zstandard", None)
    assert header(Codec(compression="auto").encode(value))[2] & F_COMP == 2
    monkeypatch.setitem(sys.modules, "lz4.frame", None)
    monkeypatch.setitem(sys.modules, "lz4", None)
    assert header(Codec(compression="auto").encode(value))[2] & F_COMP == 0


@pytest.mark.parametrize("compression,package", [("zstd", "zstandard"), ("lz4", "lz4")])
def test_missing_compressor(
    monkeypatch: pytest.MonkeyPatch, compression: str, package: str
) -> None:
    blob = Codec(compression=compression).encode(b"a" * 100_000)
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.setitem(sys.modules, "lz4.frame", None)
    with pytest.raises(MissingDependency, match=f"pip install {package}") as info:
        Codec(compression=compression)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ImportError)
    with pytest.raises(DecodeError, match=f"pip install {package}"):
        Codec().decode(blob)


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
    ],
    ids=repr,
)
def test_invalid_config(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Codec(**kwargs)


# --------------------------------------------------------------------------- damage


def sample_blobs() -> dict[str, bytes]:
    value = {"a": [1, 2.5, "x"], "b": b"\x00" * 10}
    manifest = ChunkManifest(chunks=3, size=1000, crc=1234, token="ab12")
    return {
        "plain": Codec().encode(value),
        "oob": Codec().encode([np.arange(6, dtype=np.int16), torch.arange(3)]),
        "zstd": Codec(compression="zstd", compress_threshold=0).encode(["z"] * 30),
        "lz4": Codec(compression="lz4", compress_threshold=0).encode(["l"] * 30),
        "manifest": Codec().encode_manifest(manifest),
        "falsy": Codec().encode(None),
    }


SAMPLES = sample_blobs()
samples = pytest.mark.parametrize("name", list(SAMPLES))


@samples
def test_every_flipped_byte_is_detected(name: str) -> None:
    blob = SAMPLES[name]
    assert header(blob)[3] != 0  # precondition: a real checksum
    Codec().decode(blob)  # precondition: the intact blob decodes
    for pos in range(len(blob)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[pos] ^= mask
            with pytest.raises(DecodeError):
                Codec().decode(bytes(bad))


@samples
@pytest.mark.parametrize("checksum", [True, False])
def test_every_truncation_is_detected(name: str, checksum: bool) -> None:
    blob = SAMPLES[name]
    if not checksum:  # same value, written without a checksum
        blob = blob[:3] + bytes([blob[3] | F_NOCRC]) + bytes(4) + blob[HEADER_SIZE:]
        Codec().decode(blob)
    for n in range(len(blob)):
        with pytest.raises(DecodeError):
            Codec().decode(blob[:n])


def test_checksum_off_blob_layout() -> None:
    blob = Codec(checksum=False).encode("v")
    _, _, flags, crc = header(blob)
    assert flags & F_NOCRC and crc == 0
    assert Codec().decode(blob) == "v"
    bad = blob[:4] + b"\x01\x00\x00\x00" + blob[HEADER_SIZE:]
    with pytest.raises(DecodeError, match="checksum"):
        Codec().decode(bad)


FOREIGN = [
    b"",
    b"\xac",
    b"\xacC",
    b"\xacC\x01\x00\x00\x00",
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
        Codec().decode(data)
    assert isinstance(info.value, CacheError)


def test_unknown_version() -> None:
    blob = bytearray(Codec().encode("x"))
    blob[2] = 2
    with pytest.raises(DecodeError, match="version 2"):
        Codec().decode(reseal(blob))


@pytest.mark.parametrize("flag", [0b11, 0b10_0000, 0b1000_0000], ids=["comp3", "bit5", "bit7"])
def test_unknown_flags(flag: int) -> None:
    blob = bytearray(Codec().encode("x"))
    blob[3] |= flag
    with pytest.raises(DecodeError, match="unknown"):
        Codec().decode(reseal(blob))


def test_invalid_flag_combinations() -> None:
    blob = bytearray(Codec().encode_manifest(ChunkManifest(1, 2, 3, "t")))
    blob[3] |= 1  # a "compressed" manifest is never written
    with pytest.raises(DecodeError):
        Codec().decode(reseal(blob))
    blob = bytearray(Codec().encode("plain"))
    blob[3] |= F_OOB  # plain pickle is not an out-of-band payload
    with pytest.raises(DecodeError):
        Codec().decode(reseal(blob))


def test_corrupt_compressed_payload_with_valid_crc() -> None:
    blob = bytearray(Codec(compression="zstd", compress_threshold=0).encode(["z"] * 30))
    blob[-3] ^= 0xFF
    with pytest.raises(DecodeError):
        Codec().decode(reseal(blob))


def test_unpicklable_payload_with_valid_crc() -> None:
    stream = pickle.dumps(Point(1, 2.0, []))
    stream = stream.replace(b"Point", b"Pnint")
    with pytest.raises(DecodeError, match="unpickle"):
        Codec().decode(reseal(MAGIC + b"\x01\x00" + bytes(4) + stream))


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
        Codec().encode(obj)
    assert type(obj).__qualname__ in str(info.value)
    assert "codec" in str(info.value)
    assert info.value.__cause__ is not None


def test_local_class_instance_raises_encode_error() -> None:
    class Local:
        pass

    with pytest.raises(EncodeError, match="Local"):
        Codec().encode(Local())


def test_manifest_is_not_a_cacheable_value() -> None:
    with pytest.raises(EncodeError, match="encode_manifest"):
        Codec().encode(ChunkManifest(1, 1, 1, "t"))
    with pytest.raises(EncodeError):
        Codec().encode_manifest("not a manifest")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- manifests


@all_codecs
def test_manifest_roundtrip(codec: Codec) -> None:
    manifest = ChunkManifest(chunks=12, size=2**40, crc=0xFFFFFFFF, token="tök-" + "9" * 40)
    blob = codec.encode_manifest(manifest)
    assert header(blob)[2] & F_MANIFEST and header(blob)[2] & F_COMP == 0
    out = codec.decode(blob)
    assert type(out) is ChunkManifest and out == manifest
    assert Codec().decode(blob) == manifest


@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 1000])
@pytest.mark.parametrize("chunk_size", [1, 7, 100, 5000])
def test_split_join_roundtrip(size: int, chunk_size: int) -> None:
    blob = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    parts = split_chunks(blob, chunk_size)
    manifest = ChunkManifest.for_blob(blob, chunk_size)
    assert manifest.chunks == len(parts) == math.ceil(size / chunk_size)
    assert all(len(p) <= chunk_size for p in parts)
    assert join_chunks([bytes(p) for p in parts], manifest) == blob


def test_split_chunks_is_zero_copy_and_tokens_are_fresh() -> None:
    blob = b"x" * 1000
    parts = split_chunks(blob, 300)
    assert all(isinstance(p, memoryview) and p.obj is blob for p in parts)
    assert ChunkManifest.for_blob(blob, 300).token != ChunkManifest.for_blob(blob, 300).token


def test_big_value_through_chunks_end_to_end() -> None:
    value = {"img": torch.rand(3, 64, 64), "label": 1}
    blob = DEFAULT_CODEC.encode(value)
    parts = [bytes(p) for p in split_chunks(blob, 4096)]
    manifest = DEFAULT_CODEC.decode(
        DEFAULT_CODEC.encode_manifest(ChunkManifest.for_blob(blob, 4096))
    )
    assert isinstance(manifest, ChunkManifest)
    out = DEFAULT_CODEC.decode(join_chunks(parts, manifest))
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
        {"chunks": -1, "size": 0, "crc": 0, "token": "t"},
        {"chunks": 1, "size": -1, "crc": 0, "token": "t"},
        {"chunks": 1, "size": 1, "crc": 2**32, "token": "t"},
        {"chunks": 1, "size": 1, "crc": 0, "token": ""},
        {"chunks": 1, "size": 1, "crc": 0, "token": "x" * 256},
        {"chunks": True, "size": 1, "crc": 0, "token": "t"},
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


# --------------------------------------------------------------------------- codec object


@all_codecs
def test_codec_pickles_and_compares(codec: Codec) -> None:
    clone = pickle.loads(pickle.dumps(codec))
    assert clone == codec and hash(clone) == hash(codec)
    assert clone.decode(codec.encode(NESTED)) == NESTED
    assert repr(clone) == repr(codec)
    assert f"compression={codec.compression!r}" in repr(codec)


def test_codec_equality() -> None:
    assert Codec() == DEFAULT_CODEC
    assert Codec(compression="zstd") != Codec(compression="lz4")
    assert Codec(checksum=False) != Codec()
    assert Codec() != "Codec()"


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
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(value=values)
def test_property_roundtrip_every_codec(value: object) -> None:
    for codec in CODECS.values():
        assert codec.decode(codec.encode(value)) == value


@PROPS
@given(data=st.binary(max_size=200))
def test_property_foreign_bytes_rejected(data: bytes) -> None:
    if data.startswith(MAGIC):
        data = b"\x00" + data
    with pytest.raises(DecodeError):
        Codec().decode(data)


@PROPS
@given(value=values, data=st.data())
def test_property_damage_never_returns_wrong_data(value: object, data: st.DataObject) -> None:
    """Truncation is always caught; corruption within 4 bytes is caught or harmless.

    crc32 detects every burst of <= 32 bits; the only way such an edit can decode is by
    disabling the checksum of an otherwise intact payload, which yields the right value.
    """
    codec = data.draw(st.sampled_from([CODECS["default"], CODECS["zstd"], CODECS["lz4"]]))
    blob = codec.encode(value)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(DecodeError):
        codec.decode(blob[:cut])
    start = data.draw(st.integers(0, len(blob) - 1))
    masks = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=4))
    bad = bytearray(blob)
    for i, mask in enumerate(masks):
        if start + i < len(bad):
            bad[start + i] ^= mask
    if bytes(bad) == blob:
        return
    try:
        out = codec.decode(bytes(bad))
    except DecodeError:
        return
    assert out == value


@PROPS
@given(value=values, data=st.data())
def test_property_truncation_without_checksum(value: object, data: st.DataObject) -> None:
    codec = data.draw(st.sampled_from([CODECS["nocrc"], CODECS["zstd-nocrc"]]))
    blob = codec.encode(value)
    with pytest.raises(DecodeError):
        codec.decode(blob[: data.draw(st.integers(0, len(blob) - 1))])
