"""Tests for the trusted configurations of the codec: signed values (secret=...) and
pickle-free values (allow_pickle=False), against a forger who can write any bytes to the
store. No I/O."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import math
import os
import pickle
import struct
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import PIL.Image
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynccache
import asynccache.cache.codec.codec as codec_module
import asynccache.cache.codec.general as codec_general
from asynccache.cache.codec import mac
from asynccache.cache.codec import plain as codec_plain
from asynccache.cache.codec.codec import MAGIC, ChunkManifest, Codec, join_chunks, split_chunks
from asynccache.errors import (
    ConfigError,
    DecodeError,
    EncodeError,
    FormatMismatch,
    MissingDependency,
    SignatureError,
)

# torch warns when it makes a complex32 tensor (experimental) or a quantized one (deprecated).
pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
]

KEY = b"ac:ns:42"
OTHER = b"ac:ns:43"
OLD = "old-secret-0123456789abcdef0123456789"
NEW = "new-secret-fedcba9876543210fedcba9876"
ALIEN = b"someone-else's-secret-0123456789"

F_OOB = 0b100
F_MANIFEST = 0b1000
F_NOCHECK = 0b1_0000
F_MAC = 0b10_0000
F_PLAIN = 0b100_0000

SIGNED = Codec(secret=NEW)
PLAIN = Codec(allow_pickle=False)
TRUSTED = {
    "signed": SIGNED,
    "signed-zstd": Codec(secret=NEW, compression="zstd", compress_threshold=0),
    "plain": PLAIN,
    "plain-lz4": Codec(allow_pickle=False, compression="lz4", compress_threshold=0),
    "signed-plain": Codec(secret=NEW, allow_pickle=False),
    "signed-plain-zstd": Codec(
        secret=[NEW, OLD], allow_pickle=False, compression="zstd", compress_threshold=0
    ),
}
SIGNING = {name: c for name, c in TRUSTED.items() if c._signer is not None}
PICKLE_FREE = {name: c for name, c in TRUSTED.items() if not c.allow_pickle}
trusted = pytest.mark.parametrize("codec", list(TRUSTED.values()), ids=list(TRUSTED))
signing = pytest.mark.parametrize("codec", list(SIGNING.values()), ids=list(SIGNING))
pickle_free = pytest.mark.parametrize("codec", list(PICKLE_FREE.values()), ids=list(PICKLE_FREE))


def seal(flags: int, payload: bytes, key: bytes = KEY) -> bytes:
    """A blob with a valid xxh3 tag, built from the documented layout: what anyone who can
    write to the store can make."""
    key_seed = xxhash.xxh3_64_intdigest(key, xxhash.xxh3_64_intdigest(bytes([2, flags])))
    tag = key_seed if flags & F_NOCHECK else xxhash.xxh3_64_intdigest(payload, key_seed)
    return MAGIC + bytes([2, flags]) + struct.pack("<Q", tag) + payload


def oob(stream: bytes, buffers: list[bytes]) -> bytes:
    """An out-of-band payload (table, stream, 16-byte aligned buffers), per the layout."""
    out = struct.pack("<QI", len(stream), len(buffers))
    out += struct.pack(f"<{len(buffers)}Q", *map(len, buffers)) + stream
    region = b""
    for buf in buffers:
        region += bytes(-len(region) % 16) + buf
    return out + region


class PickleCalled(BaseException):
    """Raised by the patched unpicklers: a BaseException, so no `except Exception` in the
    codec can turn a call into an ordinary DecodeError and hide it."""


@contextlib.contextmanager
def no_unpickling(allow: bool = False) -> Iterator[list[str]]:
    """Patch every unpickling entry point to record its use and raise PickleCalled (or,
    with ``allow``, to record it and unpickle)."""
    calls: list[str] = []

    def watched(name: str) -> Any:
        real = getattr(pickle, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            if not allow:
                raise PickleCalled(name)
            return real(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as mp:
        for name in ("loads", "load", "Unpickler"):
            mp.setattr(pickle, name, watched(name))
        yield calls


class Evil:
    """Unpickling this runs a shell command that creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.path}'",))


def forged_pickles(marker: Path) -> dict[str, bytes]:
    """Every way to present a malicious pickle under KEY that passes the checksum."""
    evil = pickle.dumps(Evil(marker), 5)
    big = pickle.dumps([Evil(marker), b"x" * 5000], 5)  # past the small-value hot path
    mac_tag = b"\x00" * 16
    return {
        "flags-0": seal(0, evil),
        "flags-0-large": seal(0, big),
        "out-of-band": seal(F_OOB, oob(evil, [b"buf"])),
        "zstd": seal(1, __import__("zstandard").compress(big)),
        "claims-signed": MAGIC + bytes([2, F_MAC]) + mac_tag + evil,
        "claims-signed-large": MAGIC + bytes([2, F_MAC]) + mac_tag + big,
        "claims-signed-8-byte-tag": seal(F_MAC, evil),
        "nocheck": seal(F_NOCHECK, evil),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes: compares float8 (no torch.equal), NaN and -0.0 exactly."""
    if not t.numel():
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Exact equality with types, dtypes and shapes; NaN equals NaN, -0.0 is not 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "secret", ["", b"", "fifteen-bytes!!", b"x" * 15, [], [NEW, "short"], [NEW, 3], 42]
)
def test_bad_secrets_say_how_to_make_one(secret: Any) -> None:
    with pytest.raises(ConfigError) as info:
        Codec(secret=secret)
    message = str(info.value)
    assert "secrets.token_hex(32)" in message or "not bytes" in message
    if isinstance(secret, (str, bytes)) and secret:
        assert str(secret) not in message and repr(secret) not in message


def test_sixteen_bytes_is_enough_and_str_is_its_utf8() -> None:
    assert Codec(secret="é" * 8) == Codec(secret="é".encode() * 8)  # 16 UTF-8 bytes
    assert Codec(secret=bytearray(b"k" * 16)) == Codec(secret=b"k" * 16)


def test_secret_refuses_checksum_false_and_allow_pickle_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="checksum=False"):
        Codec(secret=NEW, checksum=False)
    with pytest.raises(ConfigError, match="allow_pickle"):
        Codec(allow_pickle=0)  # type: ignore[arg-type]


def test_missing_packages_are_a_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "blake3", None)
    with pytest.raises(MissingDependency, match="pip install blake3"):
        Codec(secret=NEW)
    monkeypatch.setattr(codec_general, "_codec_plain", None)
    monkeypatch.delattr(asynccache.cache.codec, "plain")
    monkeypatch.setitem(sys.modules, "asynccache.cache.codec.plain", None)
    with pytest.raises(MissingDependency, match="pip install msgpack"):
        Codec(allow_pickle=False)
    with pytest.raises(DecodeError, match="pip install msgpack"):
        Codec().decode(seal(F_PLAIN, msgpack.packb(1)), KEY)


def test_from_env_reads_one_or_several_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCACHE_SECRET", f" {NEW} , {OLD}")
    codec = Codec.from_env(compression="lz4")
    assert codec == Codec(secret=[NEW, OLD], compression="lz4")
    assert codec.decode(Codec(secret=OLD).encode("v", KEY), KEY) == "v"
    monkeypatch.setenv("MY_SECRET", NEW)
    assert Codec.from_env("MY_SECRET") == SIGNED


def test_from_env_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCCACHE_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"ASYNCCACHE_SECRET is not set.*token_hex"):
        Codec.from_env()
    for value in (f"{NEW},", f"{NEW},,{OLD}", ""):
        monkeypatch.setenv("ASYNCCACHE_SECRET", value)
        with pytest.raises(ConfigError) as info:
            Codec.from_env()
        assert NEW not in str(info.value)


def test_equality_compares_secret_fingerprints() -> None:
    assert Codec(secret=NEW) == SIGNED and hash(Codec(secret=NEW)) == hash(SIGNED)
    different = [Codec(), Codec(secret=OLD), Codec(secret=[NEW, OLD]), Codec(secret=[OLD, NEW])]
    for other in different:
        assert other != SIGNED
    assert len({hash(c) for c in [SIGNED, *different]}) == 5
    assert Codec(allow_pickle=False) != Codec()
    assert Codec(secret=NEW, allow_pickle=False) != SIGNED


def secret_forms(secret: str) -> list[bytes]:
    raw = secret.encode()
    return [raw, raw.hex().encode(), repr(raw).encode(), raw[:16]]


def test_secret_is_in_no_repr_message_attribute_or_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = Codec(secret=[NEW, OLD])
    texts = [repr(codec), str(codec)]
    for data in (b"junk", Codec().encode(1, KEY), SIGNED.encode(1, OTHER)):
        with pytest.raises(DecodeError) as info:
            codec.decode(data, KEY)
        texts.append(str(info.value))
    with pytest.raises(ConfigError) as info:
        pickle.dumps(codec)
    texts.append(str(info.value))
    for text in texts:
        for secret in (NEW, OLD):
            assert all(form.decode(errors="replace") not in text for form in secret_forms(secret))
    assert "fingerprints" in repr(codec)
    # Nothing reachable from the codec's slots is, or contains, a secret: only hashers.
    reachable: list[object] = [getattr(codec, name) for name in Codec.__slots__]
    reachable += [getattr(codec._signer, name) for name in type(codec._signer).__slots__]
    for value in reachable:
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, (str, bytes)):
                assert NEW.encode() not in (item.encode() if isinstance(item, str) else item)
    with pytest.raises(TypeError):
        pickle.dumps(codec._signer)
    monkeypatch.setenv("ASYNCCACHE_SECRET", NEW)
    blob = pickle.dumps(Codec.from_env())
    assert all(form not in blob for form in secret_forms(NEW))


def test_explicit_secret_refuses_to_pickle_and_copies_share() -> None:
    with pytest.raises(ConfigError, match=r"from_env\(\).*fork"):
        pickle.dumps(SIGNED)
    assert copy.copy(SIGNED) is SIGNED and copy.deepcopy({"c": SIGNED})["c"] is SIGNED


def test_from_env_codec_pickles_by_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCACHE_SECRET", f"{NEW},{OLD}")
    codec = Codec.from_env(allow_pickle=False, compression="zstd")
    blob = pickle.dumps(codec)
    clone = pickle.loads(blob)
    assert clone == codec and repr(clone) == repr(codec)
    assert clone.decode(codec.encode({"a": (1, 2.5)}, KEY), KEY) == {"a": (1, 2.5)}
    monkeypatch.setenv("ASYNCCACHE_SECRET", OLD)  # another process with other secrets
    with pytest.raises(ConfigError, match="other secrets"):
        pickle.loads(blob)
    monkeypatch.delenv("ASYNCCACHE_SECRET")
    with pytest.raises(ConfigError, match="not set"):
        pickle.loads(blob)


def test_plain_codec_without_secret_pickles_as_before() -> None:
    clone = pickle.loads(pickle.dumps(PLAIN))
    assert clone == PLAIN and not clone.allow_pickle and "allow_pickle=False" in repr(clone)


# --------------------------------------------------------------------------- layout


def test_signed_layout_is_the_documented_mac() -> None:
    import blake3

    value = list(range(10))
    for codec, payload_flags in ((SIGNED, 0), (TRUSTED["signed-plain"], F_PLAIN)):
        blob = codec.encode(value, KEY)
        assert blob[:3] == MAGIC + b"\x02" and blob[3] == F_MAC | payload_flags
        mac_key = blake3.blake3(
            NEW.encode(), derive_key_context=mac.MAC_CONTEXT
        ).digest()
        mac_input = struct.pack("<Q", len(KEY)) + KEY + blob[:4] + blob[20:]
        assert blob[4:20] == blake3.blake3(mac_input, key=mac_key).digest(16)


def test_unsigned_layout_is_unchanged() -> None:
    blob = Codec().encode("x", KEY)
    assert blob == seal(0, pickle.dumps("x", 5))
    assert PLAIN.encode("x", KEY) == seal(F_PLAIN, msgpack.packb("x"))


# --------------------------------------------------------------------------- round trips


PLAIN_VALUES: dict[str, object] = {
    "none": None,
    "true": True,
    "false": False,
    "zero": 0,
    "int64-min": -(2**63),
    "uint64-max": 2**64 - 1,
    "bigint": 2**200 + 1,
    "negative-bigint": -(2**64),
    "float": 1.5,
    "negative-zero": -0.0,
    "nan": math.nan,
    "inf": -math.inf,
    "str": "héllo ✓",
    "empty-str": "",
    "bytes": bytes(range(256)),
    "empty-bytes": b"",
    "list": [1, "a", None],
    "empty-list": [],
    "tuple": (1, (2, (3,)), ()),
    "empty-tuple": (),
    "list-of-tuples": [(), [()], ((),)],
    "dict": {"a": 1, 2: "b", None: [], 1.5: (), b"k": {}, True: 0, (1, "t"): "tuple key"},
    "bool-vs-int": [True, 1, False, 0],
    "numpy-scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(7)],
    "sample": {"image": np.arange(24, dtype=np.uint8).reshape(2, 4, 3), "label": 3},
    "tensor-tuple": (torch.arange(6.0).reshape(2, 3), 7),
    "0-d": [np.array(2.5), torch.tensor(3)],
    "empty-arrays": [np.zeros((0, 3)), torch.zeros(0, 2, dtype=torch.bool)],
}


@trusted
@pytest.mark.parametrize("name", list(PLAIN_VALUES))
def test_roundtrip_keeps_types(codec: Codec, name: str) -> None:
    value = PLAIN_VALUES[name]
    with no_unpickling(allow=codec.allow_pickle) as calls:
        out = codec.decode(codec.encode(value, KEY), KEY)
    assert same(value, out), (value, out)
    assert calls == [] or codec.allow_pickle


def test_pickle_free_values_are_read_by_every_codec() -> None:
    value = PLAIN_VALUES["sample"]
    pairs = [(PLAIN, Codec()), (PLAIN, Codec(checksum=False)), (TRUSTED["signed-plain"], SIGNED)]
    for writer, reader in pairs:
        with no_unpickling() as calls:
            assert same(value, reader.decode(writer.encode(value, KEY), KEY))
        assert calls == []


NP_DTYPES = list(codec_plain._NUMPY_DTYPES)
TORCH_DTYPES = [getattr(torch, n) for n in codec_plain._TORCH_DTYPES if hasattr(torch, n)]
SHAPES = [(), (0,), (5,), (3, 4), (0, 5), (2, 1, 3)]


def _values(n: int) -> np.ndarray:
    return np.arange(n) % 5 + 1


@pickle_free
@pytest.mark.parametrize("dtype", NP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_numpy_arrays_roundtrip_writable(codec: Codec, dtype: str, shape: tuple[int, ...]) -> None:
    arr = _values(math.prod(shape)).astype(dtype).reshape(shape)
    with no_unpickling():
        out = codec.decode(codec.encode(arr, KEY), KEY)
    assert same(arr, out) and out.flags.writeable and out.flags.c_contiguous
    if out.size:
        out.flat[0] = out.flat[-1]


@pickle_free
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensors_roundtrip_writable(
    codec: Codec, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    t = torch.from_numpy(_values(math.prod(shape)).astype(np.float32)).reshape(shape).to(dtype)
    with no_unpickling():  # warnings are errors: torch.frombuffer warns on read-only memory
        out = codec.decode(codec.encode(t, KEY), KEY)
    assert same(t, out)
    if out.numel():
        bits(out)[0] = 1  # writable


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(24.0).reshape(4, 6)[:, ::2],
        lambda: np.asfortranarray(np.arange(12).reshape(3, 4)),
        lambda: np.arange(10, dtype=">i4")[::-1],  # big endian, reversed
        lambda: torch.arange(12.0).reshape(3, 4).t(),
        lambda: torch.arange(10)[::2],
        lambda: torch.tensor([1 + 2j, 3 - 4j]).conj(),
        lambda: torch.tensor([1 + 2j, 3 - 4j]).conj().imag,  # a neg view
    ],
    ids=["strided", "fortran", "big-endian", "transposed", "stepped", "conj", "neg-conj"],
)
def test_views_decode_as_their_contiguous_values(make: Any) -> None:
    value = make()
    out = PLAIN.decode(PLAIN.encode(value, KEY), KEY)
    if isinstance(value, np.ndarray):
        assert np.array_equal(out, value) and out.flags.c_contiguous and out.dtype.isnative
    else:
        assert torch.equal(out, value.resolve_conj().resolve_neg()) and out.is_contiguous()


def _root(arr: np.ndarray) -> object:
    base: object = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def test_arrays_share_one_aligned_copy_of_the_input() -> None:
    value = [np.arange(n, dtype=np.int8) for n in range(1, 6)] + [np.arange(7.0), np.ones(3)]
    blob = bytearray(PLAIN.encode(value, KEY))
    out = PLAIN.decode(blob, KEY)
    roots = {id(_root(a).obj) for a in out}  # type: ignore[attr-defined]
    assert len(roots) == 1 and id(blob) not in roots  # one region copy, not the input
    assert all(a.ctypes.data % 16 == 0 for a in out)
    tensors = [torch.zeros(n, dtype=torch.int8) for n in range(1, 4)] + [torch.ones(3)]
    assert all(t.data_ptr() % 16 == 0 for t in PLAIN.decode(PLAIN.encode(tensors, KEY), KEY))


def test_nesting_bound_is_the_same_on_both_sides() -> None:
    def nest(depth: int, leaf: object = 1) -> object:
        value = leaf
        for i in range(depth):
            value = (value,) if i % 3 == 0 else [value] if i % 3 == 1 else {"k": value}
        return value

    deepest = nest(codec_plain.MAX_DEPTH)
    blob = PLAIN.encode(deepest, KEY)
    assert PLAIN.encode(PLAIN.decode(blob, KEY), KEY) == blob  # (== would recurse too deep)
    with pytest.raises(EncodeError, match="nested deeper than 1024"):
        PLAIN.encode(nest(codec_plain.MAX_DEPTH + 1), KEY)
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(EncodeError, match="contains itself"):
        PLAIN.encode(looped, KEY)


def test_bytes_likes_msgpack_packs_itself_come_back_as_bytes() -> None:
    out = PLAIN.decode(PLAIN.encode([bytearray(b"ab"), memoryview(b"cd")], KEY), KEY)
    assert out == [b"ab", b"cd"] and all(type(b) is bytes for b in out)


def test_shared_references_are_stored_per_reference() -> None:
    shared = [1, 2]
    out = PLAIN.decode(PLAIN.encode([shared, shared], KEY), KEY)
    assert out == [shared, shared] and out[0] is not out[1]


@dataclasses.dataclass
class Point:
    x: int


class Pair(NamedTuple):
    a: int
    b: int


class Color(enum.IntEnum):
    RED = 1


UNSUPPORTED = {
    "pil": (lambda: PIL.Image.new("RGB", (2, 2)), "numpy.asarray(img)"),
    "dataclass": (lambda: Point(1), "turn it into a dict"),
    "set": (lambda: {1, 2}, "sorted(value)"),
    "frozenset": (lambda: frozenset({1}), "sorted(value)"),
    "complex": (lambda: 1 + 2j, "value.real"),
    "ordereddict": (lambda: collections.OrderedDict(a=1), "dict(value)"),
    "namedtuple": (lambda: Pair(1, 2), "_asdict()"),
    "intenum": (lambda: Color.RED, "value.value"),
    "object": (lambda: object(), "convert it"),
    "function": (lambda: len, "convert it"),
    "str-array": (lambda: np.array(["a"]), ".tolist()"),
    "object-array": (lambda: np.array([None]), ".tolist()"),
    "structured": (lambda: np.zeros(2, dtype=[("a", "i4")]), ".astype"),
    "datetime": (lambda: np.array([1, 2], dtype="datetime64[s]"), ".astype"),
    "longdouble": (lambda: np.zeros(2, dtype=np.longdouble), ".astype"),
    "masked": (lambda: np.ma.masked_array([1, 2]), "numpy.asarray"),
    "datetime-scalar": (lambda: np.datetime64(1, "s"), "bool and numeric"),
    "grad": (lambda: torch.ones(2, requires_grad=True), ".detach()"),
    "parameter": (lambda: torch.nn.Parameter(torch.ones(2)), "as_subclass"),
    "sparse": (lambda: torch.eye(2).to_sparse(), ".to_dense()"),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), ".dequantize()"
    ),
    "surrogate": (lambda: "\udcff", "UnicodeEncodeError"),
    "nested-bad": (lambda: {"ok": [1, {2, 3}]}, "sorted(value)"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_types_say_how_to_convert(name: str) -> None:
    make, advice = UNSUPPORTED[name]
    for codec in (PLAIN, TRUSTED["signed-plain"]):
        with pytest.raises(EncodeError) as info:
            codec.encode(make(), KEY)
        assert advice in str(info.value)
    # ... and the next encode in this thread still works (the packer was not left broken).
    assert PLAIN.decode(PLAIN.encode([1, (2,)], KEY), KEY) == [1, (2,)]


def test_manifest_is_not_a_value_and_chunks_of_signed_values_verify() -> None:
    with pytest.raises(EncodeError, match="encode_manifest"):
        PLAIN.encode(ChunkManifest.for_blob(b"x" * 2000, 1024), KEY)
    codec = TRUSTED["signed-plain"]
    blob = codec.encode(np.arange(5000, dtype=np.int64), KEY)
    manifest = ChunkManifest.for_blob(blob, 4096)
    signed_manifest = codec.encode_manifest(manifest, KEY)
    assert signed_manifest[3] == F_MAC | F_MANIFEST
    assert codec.decode(signed_manifest, KEY) == manifest
    parts = split_chunks(blob, manifest.chunk_size)
    assert np.array_equal(codec.decode(join_chunks(parts, manifest), KEY), np.arange(5000))
    with pytest.raises(SignatureError):
        codec.decode(signed_manifest, OTHER)
    with pytest.raises(SignatureError):  # an unsigned manifest, however well-formed
        codec.decode(Codec().encode_manifest(manifest, KEY), KEY)


# --------------------------------------------------------------------------- hostile input


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def test_the_forged_pickle_does_run_under_the_default_codec(marker: Path) -> None:
    """The attack the trusted configurations stop: a store writer runs code in readers."""
    Codec().decode(forged_pickles(marker)["flags-0"], KEY)
    assert marker.exists()


def test_the_unpickling_patch_sees_every_decode_path() -> None:
    """no_unpickling() would catch an unpickle on the hot, general and out-of-band paths."""
    for value in (1, "x" * 5000, np.arange(10)):
        blob = Codec().encode(value, KEY)
        with no_unpickling() as calls, pytest.raises(PickleCalled):
            Codec().decode(blob, KEY)
        assert calls == ["loads"]


@pytest.mark.parametrize("forgery", list(forged_pickles(Path("."))))
@trusted
def test_forged_pickle_never_runs(codec: Codec, forgery: str, marker: Path) -> None:
    blob = forged_pickles(marker)[forgery]
    expected = SignatureError if codec._signer is not None else DecodeError
    with no_unpickling() as calls, pytest.raises(expected):
        codec.decode(blob, KEY)
    assert calls == [] and not marker.exists()


@signing
def test_signed_by_another_secret_is_a_signature_error(codec: Codec) -> None:
    for options in ({}, {"allow_pickle": False}, {"compression": "zstd", "compress_threshold": 0}):
        for value in ("small", np.arange(3000)):
            blob = Codec(secret=ALIEN, **options).encode(value, KEY)
            with no_unpickling() as calls, pytest.raises(SignatureError, match="signature"):
                codec.decode(blob, KEY)
            assert calls == []


def test_rotation_reads_old_signs_new() -> None:
    old, rotated, new = Codec(secret=OLD), Codec(secret=[NEW, OLD]), Codec(secret=NEW)
    for value in ("small", {"big": np.arange(5000)}):
        assert same(value, rotated.decode(old.encode(value, KEY), KEY))
        written = rotated.encode(value, KEY)
        assert same(value, new.decode(written, KEY))
        with pytest.raises(SignatureError):
            old.decode(written, KEY)  # [old] cannot read what [new, ...] signed


@signing
def test_swapped_and_copied_values_are_signature_errors(codec: Codec) -> None:
    a, b = codec.encode("value of a", KEY), codec.encode("value of b", OTHER)
    for blob, key in ((a, OTHER), (b, KEY), (a, KEY + b"\x00"), (a, b"")):
        with pytest.raises(SignatureError):
            codec.decode(blob, key)


@signing
@pytest.mark.parametrize(
    "value", ["x" * 10, list(range(300)), np.arange(100)], ids=["small", "list", "oob"]
)
def test_every_truncation_and_bit_flip_is_a_signature_error(codec: Codec, value: object) -> None:
    blob = codec.encode(value, KEY)
    with no_unpickling() as calls:
        for n in range(len(blob)):
            with pytest.raises(SignatureError):
                codec.decode(blob[:n], KEY)
        for pos in range(len(blob)):
            for bit in (0, 5, 7):
                damaged = bytearray(blob)
                damaged[pos] ^= 1 << bit
                # Only another version is a FormatMismatch (a plain miss, never decoded).
                with pytest.raises(FormatMismatch if pos == 2 else SignatureError):
                    codec.decode(bytes(damaged), KEY)
        with pytest.raises(SignatureError):
            codec.decode(blob + b"\x00", KEY)
    assert calls == []


def test_signed_reader_refuses_unsigned_and_foreign_bytes_as_signature_errors() -> None:
    manifest = ChunkManifest.for_blob(b"x" * 5000, 1024)
    for data in (
        b"",
        b"\xac",
        b"not ours",
        Codec().encode(1, KEY),
        Codec(checksum=False).encode(1, KEY),
        PLAIN.encode(1, KEY),
        Codec().encode_manifest(manifest, KEY),
    ):
        with pytest.raises(SignatureError):
            SIGNED.decode(data, KEY)


def test_reader_without_secret_names_the_secret() -> None:
    for reader in (Codec(), Codec(checksum=False), PLAIN):
        with pytest.raises(DecodeError, match="written by a Codec with a secret") as info:
            reader.decode(SIGNED.encode(1, KEY), KEY)
        assert type(info.value) is DecodeError


def test_pickle_free_reader_refuses_pickles_even_signed_ones() -> None:
    reader = TRUSTED["signed-plain"]
    for blob in (SIGNED.encode([1], KEY), SIGNED.encode(np.arange(3000), KEY)):
        with no_unpickling() as calls, pytest.raises(DecodeError, match="never unpickles") as info:
            reader.decode(blob, KEY)
        assert calls == [] and type(info.value) is DecodeError  # signed, so not a forgery
    with no_unpickling() as calls, pytest.raises(DecodeError, match="never unpickles"):
        PLAIN.decode(Codec().encode([1], KEY), KEY)
    assert calls == []


def test_signature_is_checked_before_decompressing_or_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    touched: list[str] = []

    def spy(name: str, real: Any) -> Any:
        def call(*args: Any) -> Any:
            touched.append(name)
            return real(*args)

        return call

    for module in (codec_module, codec_general):
        for name in ("decompress", "decode_manifest", "split_oob"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    monkeypatch.setattr(codec_plain, "loads", spy("plain", codec_plain.loads))
    forged_manifest = Codec().encode_manifest(ChunkManifest.for_blob(b"x" * 5000, 1024), KEY)
    bomb = seal(1, __import__("zstandard").compress(bytes(1 << 20)))
    for blob in (forged_manifest, bomb, seal(F_OOB, oob(b"x", [b"y"])), PLAIN.encode([1], KEY)):
        for forged in (blob, blob[:3] + bytes([blob[3] | F_MAC]) + bytes(16) + blob[12:]):
            with pytest.raises(SignatureError):
                TRUSTED["signed-plain-zstd"].decode(forged, KEY)
    assert touched == []


def decode_fast(codec: Codec, blob: bytes, match: str | None = None) -> None:
    """``blob`` must fail with DecodeError within 1 s and 1 MiB + its size of memory.

    The time bound is loose on purpose: what it catches (a bomb decompressed, a loop over a
    forged count) takes many seconds, and a 2-core machine under load can pause a test for
    hundreds of ms (a 100,000-deep stream once took over 250 ms here).
    """
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with no_unpickling() as calls, pytest.raises(DecodeError, match=match):
            codec.decode(blob, KEY)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert calls == []
    assert elapsed < 1.0, elapsed
    assert peak < (1 << 20) + 2 * len(blob), peak


def ext(code: int, data: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, data))


def desc(code: int, shape: tuple[int, ...], index: int = 0, ndim: int | None = None) -> bytes:
    ndim = len(shape) if ndim is None else ndim
    return struct.pack("<BBI", code, ndim, index) + struct.pack(f"<{len(shape)}Q", *shape)


FLOAT32 = codec_plain._NUMPY_DTYPES.index("float32")
TORCH_FLOAT32 = codec_plain._TORCH_DTYPES.index("float32")
HOSTILE_STREAMS = {
    "deep-arrays": (b"\x91" * 100_000 + b"\x01", "nested deeper"),
    "deep-maps": (b"\x81\x01" * 100_000 + b"\x01", "nested deeper"),
    "huge-array": (b"\xdd\xff\xff\xff\xff", "max_array_len"),
    "huge-map": (b"\xdf\xff\xff\xff\xff", "max_map_len"),
    "huge-bin": (b"\xc6\xff\xff\xff\xff", None),
    "huge-str": (b"\xdb\xff\xff\xff\xff", None),
    "huge-ext": (b"\xc9\xff\xff\xff\xff\x02", None),
    "truncated": (msgpack.packb([1, 2, 3])[:-1], None),
    "trailing": (msgpack.packb(1) + b"\x01", "ExtraData"),
    "bad-utf8": (b"\xa2\xff\xfe", "UnicodeDecodeError"),
    "unhashable-key": (b"\x81\x91\x01\x01", "unhashable"),
    "unknown-ext": (ext(7, b"x"), "unknown extension type 7"),
    "stray-marker": (b"\x92\x01" + ext(1, b""), "tuple marker"),
    "marker-key": (b"\x81" + ext(1, b"") + b"\x01", "tuple marker"),
    "top-marker": (ext(1, b""), "tuple marker"),
    "marker-with-data": (ext(1, b"x"), "unknown extension"),
    "bad-scalar-dtype": (ext(5, b"\xff\x00"), "numpy scalar"),
    "bad-scalar-size": (ext(5, bytes([FLOAT32]) + b"\x00"), "numpy scalar"),
    "bool-scalar-of-two": (ext(5, b"\x00\x02"), "other than 0 and 1"),
    "array-without-buffer": (ext(2, desc(FLOAT32, (1,))), "buffer 0"),
    "short-descriptor": (ext(2, b"\x00\x01"), "truncated array descriptor"),
}


@pytest.mark.parametrize("name", list(HOSTILE_STREAMS))
def test_hostile_pickle_free_streams_fail_fast(name: str) -> None:
    stream, match = HOSTILE_STREAMS[name]
    for flags in (F_PLAIN, F_PLAIN | F_OOB):
        payload = stream if flags == F_PLAIN else oob(stream, [])
        decode_fast(PLAIN, seal(flags, payload), match)


HOSTILE_REFS = {  # (ext code, descriptor, buffers)
    "unknown-dtype": (2, desc(200, (1,)), [b"x"], "unknown dtype code 200"),
    "unknown-torch-dtype": (3, desc(250, (1,)), [b"x"], "unknown dtype code 250"),
    "too-many-dims": (2, desc(FLOAT32, (1,) * 65), [bytes(4)], "65 dims"),
    "ndim-disagrees": (2, desc(FLOAT32, (1, 1), ndim=3), [bytes(4)], "invalid array descriptor"),
    "index-out-of-range": (2, desc(FLOAT32, (1,), index=9), [bytes(4)], "buffer 9"),
    "overflowing-shape": (2, desc(FLOAT32, (2**64 - 1, 2**64 - 1)), [bytes(16)], "does not match"),
    "shape-disagrees": (2, desc(FLOAT32, (3,)), [bytes(16)], "does not match"),
    "tensor-shape-disagrees": (3, desc(TORCH_FLOAT32, (5,)), [bytes(16)], "does not match"),
    "empty-with-huge-dims": (2, desc(FLOAT32, (0, 2**63)), [b""], None),
    "empty-tensor-huge-dims": (3, desc(TORCH_FLOAT32, (0, 2**63)), [b""], None),
    "unreferenced-buffer": (2, desc(FLOAT32, (1,)), [bytes(4), bytes(4)], "no array refers"),
    "bool-array-of-twos": (2, desc(0, (2,)), [b"\x01\x02"], "other than 0 and 1"),
    "bool-tensor-of-twos": (3, desc(0, (2,)), [b"\x00\xff"], "other than 0 and 1"),
}


@pytest.mark.parametrize("name", list(HOSTILE_REFS))
def test_hostile_array_descriptors_fail_fast(name: str) -> None:
    code, descriptor, buffers, match = HOSTILE_REFS[name]
    decode_fast(PLAIN, seal(F_PLAIN | F_OOB, oob(ext(code, descriptor), buffers)), match)


def test_buffer_used_twice_is_refused() -> None:
    ref = msgpack.ExtType(2, desc(FLOAT32, (1,)))
    blob = seal(F_PLAIN | F_OOB, oob(msgpack.packb([ref, ref]), [bytes(4)]))
    decode_fast(PLAIN, blob, "already used")


def test_timestamp_extension_decodes_as_an_int() -> None:
    """MessagePack's one built-in extension (never written) yields a supported type."""
    assert PLAIN.decode(seal(F_PLAIN, b"\xd6\xff\x00\x00\x00\x01"), KEY) == 10**9


# --------------------------------------------------------------------------- properties


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
keys_of_dicts = (
    st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.binary(max_size=5)
)
arrays = st.builds(
    lambda dtype, shape: _values(math.prod(shape)).astype(dtype).reshape(shape),
    st.sampled_from(NP_DTYPES),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
)
tensors = st.builds(
    lambda dtype, n: torch.arange(n).to(dtype), st.sampled_from(TORCH_DTYPES), st.integers(0, 300)
)


def containers(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return (
        st.lists(children, max_size=5)
        | st.lists(children, max_size=5).map(tuple)
        | st.dictionaries(keys_of_dicts, children, max_size=5)
    )


plain_values = st.recursive(scalars | arrays | tensors, containers, max_leaves=20)
blob_keys = st.binary(max_size=40)
PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HOSTILE = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def supported(value: object) -> bool:
    """Is ``value`` made only of what allow_pickle=False can produce?"""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return True
    if type(value) in (list, tuple):
        return all(map(supported, value))  # type: ignore[arg-type]
    if type(value) is dict:
        return all(supported(k) and supported(v) for k, v in value.items())
    if type(value) is np.ndarray:
        return value.dtype.name in NP_DTYPES and value.flags.writeable
    if isinstance(value, np.generic):
        return value.dtype.name in NP_DTYPES
    if type(value) is torch.Tensor:
        return value.dtype in TORCH_DTYPES
    return False


def mutate(blob: bytes, data: st.DataObject) -> bytes:
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


@PROPS
@given(value=plain_values, key=blob_keys)
def test_property_trusted_roundtrip(value: object, key: bytes) -> None:
    for codec in TRUSTED.values():
        assert same(value, codec.decode(codec.encode(value, key), key))


def hostile_headers() -> st.SearchStrategy[bytes]:
    """Bytes past the magic, any flags (signed and pickle-free ones included)."""
    return st.builds(
        lambda v, f, rest: MAGIC + bytes([v, f]) + rest,
        st.sampled_from([2, 2, 2, 1]),
        st.integers(0, 255),
        st.binary(max_size=300),
    )


def test_property_any_bytes_are_a_decode_error_never_unpickled(record_property: Any) -> None:
    count = 0

    @HOSTILE
    @given(data=st.binary(max_size=300) | hostile_headers(), key=blob_keys)
    def check(data: bytes, key: bytes) -> None:
        nonlocal count
        count += 1
        with no_unpickling() as calls:
            for codec in TRUSTED.values():
                with pytest.raises(DecodeError) as info:
                    codec.decode(data, key)
                if codec._signer is not None:
                    assert isinstance(info.value, (SignatureError, FormatMismatch))
        assert calls == []

    check()
    record_property("hypothesis_examples", count)
    print(f"trusted any-bytes property: {count} examples")
    assert count >= HOSTILE.max_examples


def test_property_mutated_trusted_blob_is_its_value_or_a_decode_error(record_property: Any) -> None:
    """Any mutation of a trusted codec's blob decodes to exactly its value or raises a
    DecodeError (with a secret: a SignatureError, unless the version byte changed); a
    signed pickle is unpickled only when intact, a pickle-free codec never unpickles."""
    count = 0

    @HOSTILE
    @given(value=plain_values, key=blob_keys, other=blob_keys, data=st.data())
    def check(value: object, key: bytes, other: bytes, data: st.DataObject) -> None:
        nonlocal count
        count += 1
        codec = TRUSTED[data.draw(st.sampled_from(list(TRUSTED)), label="codec")]
        signed = codec._signer is not None
        blob = codec.encode(value, key)
        damaged = mutate(blob, data)
        with no_unpickling(allow=codec.allow_pickle) as calls:
            try:
                out = codec.decode(damaged, key)
            except DecodeError as exc:
                assert not signed or damaged == blob or isinstance(
                    exc, (SignatureError, FormatMismatch)
                )
            else:
                assert damaged == blob if signed else supported(out)
                assert same(value, out) or not signed
        assert calls == [] or (codec.allow_pickle and damaged == blob)
        if other != key and signed:
            with pytest.raises(SignatureError):
                codec.decode(blob, other)

    check()
    record_property("hypothesis_examples", count)
    print(f"trusted mutation property: {count} examples")
    assert count >= HOSTILE.max_examples


ext_types = st.builds(
    msgpack.ExtType,
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 127]),
    st.binary(max_size=40)
    | st.builds(
        lambda code, shape, index: desc(code, tuple(shape), index),
        st.integers(0, 255),
        st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 8), max_size=4),
        st.integers(0, 3),
    ),
)
msgpack_scalars = (  # what MessagePack itself encodes (ints are 64-bit there)
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
forged_structures = st.recursive(
    msgpack_scalars | ext_types,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(msgpack_scalars.filter(lambda k: k == k), children, max_size=3),
    max_leaves=12,
)


def leaf_types(value: object) -> set[str]:
    """Type names of everything in ``value`` (iterative: forged nesting can be deep)."""
    names, todo = set(), [value]
    while todo:
        item = todo.pop()
        names.add(type(item).__name__)
        if type(item) in (list, tuple):
            todo.extend(item)  # type: ignore[arg-type]
        elif type(item) is dict:
            todo.extend(item.keys())  # type: ignore[attr-defined]
            todo.extend(item.values())  # type: ignore[attr-defined]
    return names


def test_property_forged_pickle_free_structures(record_property: Any) -> None:
    """What a forger who knows the format can seal without a secret: any MessagePack value
    with any extension types and buffers, or a real pickle-free blob edited and resealed.
    Decoding yields only supported types (arrays writable), or a DecodeError; never
    another exception, never an unpickle."""
    count = 0
    decoded: collections.Counter[str] = collections.Counter()  # what forgeries decoded to

    @HOSTILE
    @given(
        which=st.sampled_from(["structure", "raw", "edited"]),
        structure=forged_structures,
        buffers=st.lists(st.binary(max_size=64), max_size=3),
        raw=st.binary(max_size=200),
        value=plain_values,
        data=st.data(),
    )
    def check(
        which: str,
        structure: object,
        buffers: list[bytes],
        raw: bytes,
        value: object,
        data: st.DataObject,
    ) -> None:
        nonlocal count
        count += 1
        if which == "edited":
            blob = PLAIN.encode(value, KEY)
            candidates = [(blob[3], mutate(blob[12:], data))]
        else:
            stream = msgpack.packb(structure) if which == "structure" else raw
            candidates = [(F_PLAIN, stream), (F_PLAIN | F_OOB, oob(stream, buffers))]
        for flags, payload in candidates:
            with no_unpickling() as calls:
                try:
                    out = PLAIN.decode(seal(flags, payload), KEY)
                except DecodeError:
                    pass
                else:
                    assert supported(out), out
                    decoded.update(leaf_types(out))
            assert calls == []

    check()
    record_property("hypothesis_examples", count)
    print(f"forged pickle-free structures property: {count} examples, decoded {dict(decoded)}")
    assert decoded["list"] + decoded["dict"] > 100  # the parser was reached, not only refused
    assert count >= HOSTILE.max_examples
