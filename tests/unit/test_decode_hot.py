"""A reply's small values decoded in one call (`Codec.decode_hot`), and ``MGET`` packed
with one join: the same answers as the one-by-one paths, whatever the reply holds."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asynccache as ac
from asynccache.store.protocol.resp import pack_mget

KEYS = [b"ns:%d" % i for i in range(40)]


def _one_by_one(codec: ac.Codec, blobs: list[Any], keys: list[bytes]) -> list[Any]:
    out = []
    for blob, key in zip(blobs, keys, strict=True):
        if blob is None or type(blob) is object:
            out.append("absent")
            continue
        try:
            out.append(codec.decode(blob, key))
        except ac.DecodeError:
            out.append("refused")
    return out


@st.composite
def replies(draw: st.DrawFn, codec: ac.Codec) -> tuple[list[Any], list[bytes]]:
    """A reply of small values with absent ones, damage, values of other keys, large
    ones, values of another codec and foreign bytes mixed in."""
    n = draw(st.integers(1, len(KEYS)))
    keys, blobs = KEYS[:n], []
    other = ac.Codec(secret=b"k" * 32)
    for i, key in enumerate(keys):
        value = draw(st.one_of(st.binary(max_size=60), st.integers(), st.none(),
                               st.lists(st.integers(), max_size=5)))
        kind = draw(st.sampled_from(["ok"] * 6 + ["none", "flip", "cut", "other-key", "big",
                                                  "signed", "foreign", "marker"]))
        blob = codec.encode(value, key)
        if kind == "none":
            blob = None
        elif kind == "flip":
            at = draw(st.integers(0, len(blob) - 1))
            blob = blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:]
        elif kind == "cut":
            blob = blob[:draw(st.integers(0, len(blob) - 1))]
        elif kind == "other-key":
            blob = codec.encode(value, KEYS[(i + 1) % len(KEYS)])
        elif kind == "big":
            blob = codec.encode(b"x" * 5000, key)
        elif kind == "signed":
            blob = other.encode(value, key)
        elif kind == "foreign":
            blob = pickle.dumps(value)
        elif kind == "marker":
            blob = object()  # NOT_READ and friends: never bytes
        blobs.append(blob)
    return blobs, list(keys)


CODECS = [ac.Codec(), ac.Codec(secret=b"s" * 32), ac.Codec(allow_pickle=False),
          ac.Codec(checksum=False), ac.Codec(compression="zstd", compress_threshold=0)]


@pytest.mark.parametrize("codec", CODECS, ids=["plain", "signed", "pickle-free", "nocheck",
                                               "zstd"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_decode_hot_agrees_with_decode_value_by_value(codec: ac.Codec,
                                                      data: st.DataObject) -> None:
    blobs, keys = data.draw(replies(codec))
    sentinel = object()
    out: list[Any] = [sentinel] * len(blobs)
    rest, nbytes, largest = codec.decode_hot(blobs, keys, out)
    expected = _one_by_one(codec, blobs, keys)
    done = [i for i in range(len(blobs)) if i not in set(rest)]
    assert rest == sorted(rest)
    for i in done:  # what it decoded is what decode() gives
        assert out[i] == expected[i] and expected[i] not in ("absent", "refused")
    for i in rest:  # what it left is untouched, and decode() decides it
        assert out[i] is sentinel
    decoded = [blobs[i] for i in done]
    assert nbytes == sum(map(len, decoded))
    assert largest == max(map(len, decoded), default=0)
    for i, blob in enumerate(blobs):  # a small value of this codec's hot kind is taken
        if expected[i] not in ("absent", "refused") and type(blob) is bytes \
                and len(blob) <= 2048 and codec == ac.Codec():
            assert i in done


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=30), min_size=1, max_size=70),
       st.booleans())
def test_pack_mget_is_the_resp_framing_of_every_key(keys: list[bytes], same: bool) -> None:
    if same:  # keys of one length: the one-join path
        keys = [k.ljust(30, b"_") for k in keys]
    expected = b"*%d\r\n$4\r\nMGET\r\n" % (len(keys) + 1) + b"".join(
        b"$%d\r\n%s\r\n" % (len(k), k) for k in keys)
    assert pack_mget(keys) == expected
