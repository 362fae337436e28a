"""Decoding over a buffer of the value's own: out-of-band arrays and tensors become views
of the memory the value was received into (no copy), aligned, writable; everything else
(bytes input, compressed values, values written before the layout aligned the buffers)
is copied once, as before.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

import asynccache as ac
from asynccache.cache.codec.format import FIXED
from asynccache.cache.codec.pickling import ALIGN, OOB_HEAD, oob_parts, split_oob

KEY = b"ns:k"


def _received(blob: bytes) -> memoryview:
    """``blob`` as a reader receives a large value: a fresh allocation of its own."""
    buf = np.empty(len(blob), dtype=np.uint8)
    buf[:] = np.frombuffer(blob, dtype=np.uint8)
    return memoryview(buf)


def _region_offset(blob: bytes, head: int) -> int:
    stream_len, nbuf = OOB_HEAD.unpack_from(blob, head)
    return head + OOB_HEAD.size + 8 * nbuf + stream_len


CODECS = {
    "plain": ac.Codec(),
    "signed": ac.Codec(secret=b"s" * 32),
    "nocheck": ac.Codec(checksum=False),
}


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("stream_extra", [0, 1, 7, 15, 33])
def test_encode_starts_the_buffer_region_aligned_from_the_value_start(
        name: str, stream_extra: int) -> None:
    codec = CODECS[name]
    value = {"label": "x" * stream_extra, "a": np.arange(1000, dtype=np.float32),
             "b": np.arange(77, dtype=np.int8)}
    blob = codec.encode(value, KEY)
    head = FIXED.size + codec._tag_size
    assert _region_offset(blob, head) % ALIGN == 0


@pytest.mark.parametrize("name", list(CODECS))
def test_an_owned_buffer_is_decoded_into_views_of_it(name: str) -> None:
    codec = CODECS[name]
    value = {"a": np.arange(4096, dtype=np.float64), "b": np.arange(300, dtype=np.int16)}
    buf = _received(codec.encode(value, KEY))
    out = codec.decode(buf, KEY, owned=True)
    assert isinstance(out, dict)
    for name_ in ("a", "b"):
        arr = out[name_]
        np.testing.assert_array_equal(arr, value[name_])
        assert np.shares_memory(arr, np.asarray(buf))
        assert arr.flags.writeable and arr.flags.aligned
        assert arr.ctypes.data % ALIGN == 0


def test_not_owned_input_is_copied_and_the_value_owns_its_memory() -> None:
    codec = ac.Codec()
    value = np.arange(10_000, dtype=np.float32)
    blob = codec.encode(value, KEY)
    buf = _received(blob)
    for data, owned in ((buf, False), (blob, True), (bytearray(blob), False)):
        out = codec.decode(data, KEY, owned=owned)
        np.testing.assert_array_equal(out, value)
        if not isinstance(data, bytes):
            assert not np.shares_memory(out, np.asarray(memoryview(data)))
        assert out.flags.writeable


def test_a_read_only_buffer_is_copied_even_when_called_owned() -> None:
    codec = ac.Codec()
    value = np.arange(10_000, dtype=np.float32)
    ro = np.frombuffer(codec.encode(value, KEY), dtype=np.uint8)  # read-only
    out = codec.decode(memoryview(ro), KEY, owned=True)
    np.testing.assert_array_equal(out, value)
    assert out.flags.writeable and not np.shares_memory(out, ro)


def test_the_layout_before_alignment_still_decodes_with_a_copy() -> None:
    """A value written by a release that did not pad the stream: unaligned region, so an
    owned buffer is copied (never a misaligned view), and the value is the same."""
    codec = ac.Codec()
    value = np.arange(5000, dtype=np.float64)
    bufs: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(value, 5, buffer_callback=bufs.append)
    parts, size = oob_parts(stream, [b.raw() for b in bufs])  # no head: no pad
    from asynccache.cache.codec.format import F_OOB

    blob = codec._finish(KEY, F_OOB, parts, size)
    head = FIXED.size + codec._tag_size
    if _region_offset(blob, head) % ALIGN == 0:  # make it unaligned: one byte more stream
        parts, size = oob_parts(stream + b".", [b.raw() for b in bufs])
        blob = codec._finish(KEY, F_OOB, parts, size)
    assert _region_offset(blob, head) % ALIGN != 0
    buf = _received(blob)
    out = codec.decode(buf, KEY, owned=True)
    np.testing.assert_array_equal(out, value)
    assert not np.shares_memory(out, np.asarray(buf))
    assert out.ctypes.data % ALIGN == 0


def test_a_compressed_value_is_never_a_view_of_the_received_bytes() -> None:
    codec = ac.Codec(compression="zstd", compress_threshold=0)
    value = np.zeros(50_000, dtype=np.float32)
    buf = _received(codec.encode(value, KEY))
    out = codec.decode(buf, KEY, owned=True)
    np.testing.assert_array_equal(out, value)
    assert not np.shares_memory(out, np.asarray(buf))


def test_pickle_free_values_decode_in_place_when_aligned_and_right_either_way() -> None:
    codec = ac.Codec(allow_pickle=False)
    for n in range(1, 40):
        value = {"x": np.arange(n * 37, dtype=np.float32), "s": "y" * n}
        buf = _received(codec.encode(value, KEY))
        out = codec.decode(buf, KEY, owned=True)
        np.testing.assert_array_equal(out["x"], value["x"])
        assert out["s"] == value["s"] and out["x"].flags.writeable


def test_a_torch_tensor_is_a_view_of_the_owned_buffer() -> None:
    torch = pytest.importorskip("torch")
    codec = ac.Codec()
    value = torch.arange(100_000, dtype=torch.float32).reshape(100, 1000)
    buf = _received(codec.encode(value, KEY))
    out = codec.decode(buf, KEY, owned=True)
    assert torch.equal(out, value)
    base = np.asarray(buf)
    assert base.ctypes.data <= out.data_ptr() < base.ctypes.data + base.nbytes
    assert out.data_ptr() % ALIGN == 0
    out += 1  # writable, and changes nothing but this value
    assert torch.equal(out, value + 1)


def test_split_oob_refuses_forged_tables_in_place_as_when_copying() -> None:
    good = bytearray(ac.Codec().encode(np.arange(64, dtype=np.int64), KEY))[FIXED.size + 8:]
    forged = bytearray(good)
    struct.pack_into("<Q", forged, OOB_HEAD.size, 10**9)  # the one buffer claims 1 GB
    with pytest.raises(ac.DecodeError):
        split_oob(memoryview(forged), 0)
    _stream, buffers = split_oob(memoryview(good), FIXED.size + 8)
    assert len(buffers) == 1 and buffers[0].nbytes == 64 * 8
