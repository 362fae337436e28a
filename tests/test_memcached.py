"""memcached: the sans-IO text protocol, both connections, and per-node health of a pool.

The protocol tests use no sockets. The rest run against real memcached servers (the
session fixtures, or private ones for tests that kill, restart or constrain a server),
through asynccache.proxy.FaultProxy for latency, and against a scripted loopback server
for what a real memcached will not do on demand (close right after a request, send a
value nobody asked for).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.protocol.memcache import (
    DELETED,
    NOT_FOUND,
    STORED,
    VERSION,
    ErrorReply,
    ProtocolViolation,
    ReplyParser,
    Request,
    pack_delete,
    pack_get,
    pack_set,
)

# -- the text protocol, no sockets ----------------------------------------------------


def parse(requests: list[Request], stream: bytes, step: int = 0, max_value: int = 1 << 20
          ) -> list[object]:
    """Every reply of ``stream`` for ``requests``, fed whole (step 0) or ``step`` bytes
    at a time; asserts nothing is left over."""
    parser = ReplyParser(max_value)
    for request in requests:
        parser.expect(request)
    replies: list[object] = []
    pieces = [stream] if not step else [stream[i:i + step] for i in range(0, len(stream), step)]
    for piece in pieces:
        parser.feed(piece)
        while (reply := parser.next()) is not None:
            replies.append(reply)
    assert parser.waiting == 0 and parser.buffered == 0
    return replies


def test_requests_are_packed_as_buffers_without_copying_the_value() -> None:
    value = bytearray(b"x" * 1000)
    request = pack_set(b"k", value, 60, flags=3)
    assert request.buffers[0] == b"set k 3 60 1000\r\n"
    assert request.buffers[1] is value and request.buffers[2] == b"\r\n"
    assert pack_get([b"a", b"b"]).buffers == (b"get a b\r\n",)
    assert pack_get([b"a", b"b"]).keys == (b"a", b"b")
    assert pack_delete(b"a").buffers == (b"delete a\r\n",)
    assert VERSION.buffers == (b"version\r\n",)
    with pytest.raises(ValueError):
        pack_get([])


@pytest.mark.parametrize("step", [0, 1, 2, 7])
def test_pipelined_replies_split_at_any_byte(step: int) -> None:
    requests = [pack_get([b"a", b"b", b"c"]), pack_set(b"a", b"1", 0), pack_delete(b"a"),
                pack_delete(b"z"), VERSION, pack_get([b"q"]), pack_set(b"big", b"", 0)]
    stream = (b"VALUE a 0 2\r\nA!\r\nVALUE c 5 0\r\n\r\nEND\r\n"
              b"STORED\r\nDELETED\r\nNOT_FOUND\r\nVERSION 1.6.21\r\n"
              b"END\r\nSERVER_ERROR object too large for cache\r\n")
    assert parse(requests, stream, step) == [
        [b"A!", None, b""], STORED, DELETED, NOT_FOUND, b"VERSION 1.6.21", [None],
        ErrorReply(b"SERVER_ERROR", "object too large for cache")]


def test_values_may_contain_protocol_words_and_a_cas_field() -> None:
    tricky = b"END\r\nVALUE b 0 1\r\nx\r\n"
    stream = b"VALUE a 0 %d 99\r\n%s\r\nEND\r\n" % (len(tricky), tricky)
    assert parse([pack_get([b"a", b"b"])], stream, 1) == [[tricky, None]]


def test_out_of_order_hits_are_placed_by_key() -> None:
    stream = b"VALUE c 0 1\r\n3\r\nVALUE a 0 1\r\n1\r\nEND\r\n"
    assert parse([pack_get([b"a", b"b", b"c"])], stream) == [[b"1", None, b"3"]]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.binary(min_size=1, max_size=12).map(lambda b: b.hex().encode()),
                       st.one_of(st.none(), st.binary(max_size=300))),
             min_size=1, max_size=20, unique_by=lambda kv: kv[0]),
    st.integers(min_value=1, max_value=64),
)
def test_any_get_reply_split_anywhere_is_aligned_with_its_keys(
    items: list[tuple[bytes, bytes | None]], step: int
) -> None:
    keys = [k for k, _ in items]
    stream = b"".join(b"VALUE %s 0 %d\r\n%s\r\n" % (k, len(v), v) for k, v in items
                      if v is not None) + b"END\r\n"
    requests = [pack_get(keys), pack_set(keys[0], b"v", 0)]
    assert parse(requests, stream + b"STORED\r\n", step) == [[v for _, v in items], STORED]


def test_a_large_value_in_many_chunks() -> None:
    value = bytes(range(256)) * 4096  # 1 MiB
    stream = b"VALUE big 0 %d\r\n%s\r\nEND\r\n" % (len(value), value)
    assert parse([pack_get([b"big"])], stream, 65536, max_value=2 << 20) == [[value]]


def test_error_replies_are_values() -> None:
    requests = [pack_get([b"a"]), pack_set(b"a", b"1", 0), pack_delete(b"a")]
    stream = (b"SERVER_ERROR out of memory writing get response\r\n"
              b"CLIENT_ERROR bad data chunk\r\nERROR\r\n")
    first, second, third = parse(requests, stream, 3)
    assert first == ErrorReply(b"SERVER_ERROR", "out of memory writing get response")
    assert first.in_sync and not second.in_sync and not third.in_sync
    assert str(second) == "CLIENT_ERROR bad data chunk" and str(third) == "ERROR"


def test_a_value_over_the_bound_is_refused_before_its_bytes_arrive() -> None:
    parser = ReplyParser(max_value=1000)
    parser.expect(pack_get([b"a"]))
    parser.feed(b"VALUE a 0 4294967296\r\n")  # no 4 GB buffer: the header alone is refused
    with pytest.raises(ProtocolViolation, match="bound"):
        parser.next()


def test_an_endless_line_is_refused() -> None:
    parser = ReplyParser(max_value=1000)
    parser.expect(VERSION)
    parser.feed(b"VERSION " + b"9" * 10_000)
    with pytest.raises(ProtocolViolation, match="CRLF"):
        parser.next()


@pytest.mark.parametrize(("request_", "stream", "match"), [
    (pack_get([b"a"]), b"VALUE b 0 1\r\nx\r\nEND\r\n", "not asked"),
    (pack_get([b"a"]), b"VALUE a 0 1\r\nxy\r\nEND\r\n", "CRLF"),
    (pack_get([b"a"]), b"VALUE a zero\r\nEND\r\n", "malformed"),
    (pack_get([b"a"]), b"STORED\r\n", "unexpected line"),
    (pack_delete(b"a"), b"STORED\r\n", "unexpected reply"),
    (VERSION, b"END\r\n", "unexpected reply"),
])
def test_a_reply_that_does_not_fit_its_request_is_a_violation(
    request_: Request, stream: bytes, match: str
) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        parse([request_], stream)


def test_bytes_nobody_asked_for_are_a_violation() -> None:
    parser = ReplyParser(max_value=1000)
    parser.expect(VERSION)
    parser.feed(b"VERSION 1\r\nSTORED\r\n")
    assert parser.next() == b"VERSION 1"
    with pytest.raises(ProtocolViolation, match="no request"):
        parser.next()
