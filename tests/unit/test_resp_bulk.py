"""BulkReader, the MGET reply parser for large values: same replies as hiredis, however
the bytes are split, and bounded on hostile input (no I/O)."""

from __future__ import annotations

import itertools

import hiredis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.store.protocol.resp_bulk import MAX_LINE, BulkReader, ProtocolError


def mget_reply(values: list[bytes | None]) -> bytes:
    parts = [b"*%d\r\n" % len(values)]
    for v in values:
        parts.append(b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v))
    return b"".join(parts)


def read_all(reader: BulkReader, data: bytes, cuts: list[int]) -> list:
    """Feed ``data`` split at ``cuts`` through buffer()/received(), collecting replies."""
    out = []
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    for lo, hi in itertools.pairwise(bounds):
        view = memoryview(data)[lo:hi]
        while view:
            room = reader.buffer()
            assert len(room) > 0
            n = min(len(room), len(view))
            room[:n] = view[:n]
            reader.received(n)
            view = view[n:]
            while (reply := reader.gets()) is not False:
                out.append(reply)
    return out


values_st = st.lists(st.one_of(st.none(), st.binary(max_size=300)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(replies=st.lists(values_st, min_size=1, max_size=4),
       cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=12),
       big=st.sampled_from([1, 16, 64, 1 << 16]))
def test_same_replies_as_hiredis_however_the_bytes_are_split(
    replies: list[list[bytes | None]], cuts: list[int], big: int
) -> None:
    data = b"".join(mget_reply(r) for r in replies)
    got = read_all(BulkReader(big=big), data, cuts)
    h = hiredis.Reader()
    h.feed(data)
    expected = []
    while (reply := h.gets()) is not False:
        expected.append(reply)
    assert [[None if v is None else bytes(v) for v in r] for r in got] == expected
    assert got == [[None if v is None else v for v in r] for r in replies]


def test_large_values_land_in_their_own_buffer() -> None:
    buffers = []

    def alloc(n: int) -> bytearray:
        buffers.append(bytearray(n))
        return buffers[-1]

    big = bytes(range(256)) * 1024  # 256 KiB
    reader = BulkReader(big=64 << 10, alloc=alloc)
    got = read_all(reader, mget_reply([b"small", big, None]), cuts=list(range(0, 300_000, 7_000)))
    assert got == [[b"small", big, None]]
    assert len(buffers) == 1 and got[0][1] is buffers[0]  # received in place, not copied out
    assert reader.idle


def test_an_error_reply_is_a_reply_error() -> None:
    reader = BulkReader()
    reader.feed(b"-NOPERM this user has no permissions\r\n")
    reply = reader.gets()
    assert isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOPERM")


def test_status_and_integer_replies_are_what_hiredis_gives() -> None:
    """The replies of the setup commands (``AUTH``, ``SELECT``: ``+OK``) and ``PING`` on
    a connection that otherwise only sends ``MGET``."""
    data = b"+OK\r\n+PONG\r\n:42\r\n:-1\r\n" + mget_reply([b"a", None])
    h = hiredis.Reader()
    h.feed(data)
    expected = []
    while (reply := h.gets()) is not False:
        expected.append(reply)
    for cuts in ([], list(range(len(data)))):
        assert read_all(BulkReader(big=1), data, cuts) == expected


@pytest.mark.parametrize("data", [
    b"$3\r\nabc\r\n",                # a bulk string outside an array
    b"*1\r\n:5\r\n",                 # an integer element
    b"*1\r\n$3\r\nabcX\n",           # no CRLF after the value
    b"*-1\r\n",                      # a nil array
    b"*1\r\n$x\r\n",                 # not a length
    b"*1\r\n$99999999999\r\n",       # over max_value
    b"*99999999\r\n",                # over max_items
])
def test_what_is_not_an_mget_reply_is_a_protocol_error(data: bytes) -> None:
    reader = BulkReader(max_value=1 << 20, max_items=1 << 16)
    reader.feed(data)
    with pytest.raises(ProtocolError):
        reader.gets()


def test_a_header_line_without_end_is_bounded() -> None:
    reader = BulkReader()
    reader.feed(b"*" + b"1" * (MAX_LINE + 10))
    with pytest.raises(ProtocolError):
        reader.gets()


def test_an_incomplete_reply_waits_and_then_completes() -> None:
    reader = BulkReader(big=4)
    data = mget_reply([b"abcdefgh", b"xy"])
    reader.feed(data[:-3])
    assert reader.gets() is False and not reader.idle
    reader.feed(data[-3:])
    assert reader.gets() == [b"abcdefgh", b"xy"] and reader.idle


def test_many_small_values_grow_the_buffer() -> None:
    values = [b"v%06d" % i for i in range(60_000)]  # ~ 900 KB of reply, small values
    reader = BulkReader()
    assert read_all(reader, mget_reply(values), cuts=[]) == [values]
