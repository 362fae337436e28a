"""The memcached get-reply parser against a reference written for clarity, not speed.

The parser has a fast path (the next key's hit, flags 0, no cas, complete in the buffer)
and a general path that checks every field. Whatever bytes arrive, fed whole or a few at
a time, it must answer exactly as the reference does: the same values at the same
positions, the same refusal, or "not complete yet". The streams are valid replies (hits
in or out of order, flags, cas fields, values that contain protocol words) and valid
replies with bytes changed, cut, inserted or removed, so the general path's checks are
exercised through the fast path's fall-throughs.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.store.protocol.memcache import (
    ErrorReply,
    ProtocolViolation,
    ReplyParser,
    pack_get,
    safe_memcached_key,
    safe_memcached_keys,
)

MAX_VALUE = 512
INCOMPLETE = "incomplete"
VIOLATION = "violation"


def reference(keys: list[bytes], stream: bytes, max_value: int = MAX_VALUE) -> Any:
    """The reply to ``get keys`` at the start of ``stream``: values aligned with ``keys``,
    an ErrorReply, INCOMPLETE or VIOLATION. Short streams only (no line bound here)."""
    index = {key: i for i, key in enumerate(keys)}
    values: list[bytes | None] = [None] * len(keys)
    pos = 0
    while True:
        eol = stream.find(b"\r\n", pos)
        if eol < 0:
            return INCOMPLETE
        line = stream[pos:eol]
        if line == b"END":
            return values
        word, _, rest = line.partition(b" ")
        if word in (b"SERVER_ERROR", b"CLIENT_ERROR", b"ERROR"):
            return ErrorReply(word, rest.decode("utf-8", "replace"))
        if word != b"VALUE":
            return VIOLATION
        fields = rest.split(b" ")
        if len(fields) not in (3, 4) or not fields[2].isdigit():
            return VIOLATION
        size = int(fields[2])
        if size > max_value:
            return VIOLATION
        end = eol + 2 + size
        if end + 2 > len(stream):
            return INCOMPLETE
        if stream[end:end + 2] != b"\r\n" or fields[0] not in index:
            return VIOLATION
        values[index[fields[0]]] = stream[eol + 2:end]
        pos = end + 2


def parsed(keys: list[bytes], stream: bytes, step: int) -> Any:
    """What ReplyParser makes of ``stream`` fed ``step`` bytes at a time (0: whole)."""
    parser = ReplyParser(MAX_VALUE)
    parser.expect(pack_get(keys))
    pieces = [stream] if not step else [stream[i:i + step] for i in range(0, len(stream), step)]
    try:
        for piece in pieces:
            parser.feed(piece)
            reply = parser.next()
            if reply is not None:
                return reply
    except ProtocolViolation:
        return VIOLATION
    return INCOMPLETE


key_st = st.binary(min_size=1, max_size=6).map(lambda b: b.hex().encode())
value_st = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"", b"\r\n", b"END\r\n", b"VALUE a 0 1\r\nx\r\nEND", b" 0 12\r\n"]),
)


@st.composite
def get_replies(draw: st.DrawFn) -> tuple[list[bytes], bytes]:
    """Keys asked, and a well-formed reply: some hits, maybe out of order, some with flags
    or a cas field, ``END`` (or an error line) at the end."""
    keys = draw(st.lists(key_st, min_size=1, max_size=8, unique=True))
    hits = draw(st.lists(st.sampled_from(keys), unique=True, max_size=len(keys)))
    if draw(st.booleans()):
        hits.sort(key=keys.index)  # what memcached does: request order
    parts = []
    for key in hits:
        value = draw(value_st)
        flags = draw(st.sampled_from([0, 0, 0, 1, 4294967295]))
        cas = draw(st.sampled_from([b"", b"", b" 7", b" 18446744073709551615"]))
        parts.append(b"VALUE %s %d %d%s\r\n%s\r\n" % (key, flags, len(value), cas, value))
    parts.append(draw(st.sampled_from([b"END\r\n"] * 5 + [b"SERVER_ERROR busy\r\n"])))
    return keys, b"".join(parts)


@st.composite
def damaged(draw: st.DrawFn, replies: st.SearchStrategy[tuple[list[bytes], bytes]]
            ) -> tuple[list[bytes], bytes]:
    """A reply with a few bytes replaced, removed, inserted, or the stream cut short."""
    keys, stream = draw(replies)
    data = bytearray(stream)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        at = draw(st.integers(min_value=0, max_value=len(data)))
        kind = draw(st.sampled_from(["replace", "replace2", "remove", "insert", "cut"]))
        if kind == "replace" and at < len(data):
            data[at] = draw(st.sampled_from(b"0123456789 \r\nVALUEND\x00\xff"))
        elif kind == "replace2":  # two at once: a CRLF becomes something else
            data[at:at + 2] = draw(st.sampled_from([b"..", b"\r.", b".\n", b"\n\r", b"  "]))
        elif kind == "remove":
            del data[at:at + draw(st.integers(min_value=1, max_value=4))]
        elif kind == "insert":
            data[at:at] = draw(st.sampled_from([b" ", b"0", b"9", b"\r\n", b"\x00", b"VALUE "]))
        else:
            del data[at:]
    return keys, bytes(data)


@st.composite
def all_hits(draw: st.DrawFn) -> tuple[list[bytes], bytes]:
    """What asynccache mostly gets: every key a hit with flags 0, in request order, small
    values (the rest of such a reply is split in one pass); sometimes two hits swapped,
    one with flags, a cas or a CRLF in it, a value over the bound, or a miss."""
    keys = draw(st.lists(key_st, min_size=3, max_size=30, unique=True))
    values = [draw(st.binary(max_size=40)) for _ in keys]
    flags = [0] * len(keys)
    cas = [b""] * len(keys)
    order = list(range(len(keys)))
    odd = draw(st.sampled_from(["none", "swap", "flags", "cas", "crlf", "big", "miss"]))
    at = draw(st.integers(min_value=1, max_value=len(keys) - 1))
    if odd == "swap":
        other = draw(st.integers(min_value=1, max_value=len(keys) - 1))
        order[at], order[other] = order[other], order[at]
    elif odd == "flags":
        flags[at] = 1
    elif odd == "cas":
        cas[at] = b" 1"
    elif odd == "crlf":
        values[at] += b"\r\n"
    elif odd == "big":
        values[at] = b"x" * (MAX_VALUE + 1)
    elif odd == "miss":
        del order[at]
    stream = b"".join(b"VALUE %s %d %d%s\r\n%s\r\n" % (keys[i], flags[i], len(values[i]),
                                                        cas[i], values[i]) for i in order)
    return keys, stream + b"END\r\n"


@settings(max_examples=400, deadline=None)
@given(all_hits(), st.sampled_from([0, 0, 0, 1, 5, 64]))
def test_replies_of_all_hits_are_parsed_as_the_reference_does(
    case: tuple[list[bytes], bytes], step: int
) -> None:
    keys, stream = case
    assert parsed(keys, stream, step) == reference(keys, stream)


@settings(max_examples=400, deadline=None)
@given(damaged(all_hits()), st.sampled_from([0, 0, 0, 1, 5, 64]))
def test_damaged_replies_of_all_hits_get_the_reference_answer(
    case: tuple[list[bytes], bytes], step: int
) -> None:
    keys, stream = case
    assert parsed(keys, stream, step) == reference(keys, stream)


@settings(max_examples=400, deadline=None)
@given(get_replies(), st.integers(min_value=0, max_value=17))
def test_well_formed_replies_are_parsed_as_the_reference_does(
    case: tuple[list[bytes], bytes], step: int
) -> None:
    keys, stream = case
    expected = reference(keys, stream)
    assert expected not in (INCOMPLETE, VIOLATION)
    assert parsed(keys, stream, step) == expected


@settings(max_examples=1500, deadline=None)
@given(damaged(get_replies()), st.integers(min_value=0, max_value=17))
def test_damaged_replies_get_the_reference_answer_whole_or_in_pieces(
    case: tuple[list[bytes], bytes], step: int
) -> None:
    keys, stream = case
    assert parsed(keys, stream, step) == reference(keys, stream)


@pytest.mark.parametrize(("stream", "expected"), [
    # the fast path must not take these for a plain hit
    (b"VALUE a 0 1 5\r\nx\r\nEND\r\n", [b"x", None]),               # a cas field
    (b"VALUE a 0 01\r\nx\r\nEND\r\n", [b"x", None]),                # leading zero: digits
    (b"VALUE a 0 +1\r\nx\r\nEND\r\n", VIOLATION),                   # int() would take these
    (b"VALUE a 0  1\r\nx\r\nEND\r\n", VIOLATION),
    (b"VALUE a 0 1_0\r\n0123456789\r\nEND\r\n", VIOLATION),
    (b"VALUE a 0 -1\r\nEND\r\n", VIOLATION),
    (b"VALUE a 0 12345678901\r\n", VIOLATION),                      # over the bound, 11 digits
    (b"VALUE a 0 513\r\n", VIOLATION),                              # over the bound
    (b"VALUE a 0 513\r\n" + b"x" * 513 + b"\r\nEND\r\n", VIOLATION),  # ... even if all here
    (b"VALUE a 0 1\r\nxy\r\nEND\r\n", VIOLATION),                   # value longer than said
    (b"VALUE a 0 1\r\nx..END\r\n", VIOLATION),                      # no CRLF after the value
    (b"VALUE a 0 1\r\nx\r.VALUE b 0 1\r\ny\r\nEND\r\n", VIOLATION),
    (b"VALUE aa 0 1\r\nx\r\nEND\r\n", VIOLATION),                   # a key that starts like one
    (b"VALUE b 0 1\r\nx\r\nVALUE a 0 1\r\ny\r\nEND\r\n", [b"y", b"x"]),
    (b"VALUE a 0 1\r\nx\r\nVALUE a 0 1\r\ny\r\nEND\r\n", [b"y", None]),  # as the reference
    (b"VALUE a 0 1\r\nx", INCOMPLETE),
    (b"VALUE a 0 1", INCOMPLETE),
])
def test_lines_the_fast_path_must_leave_to_the_checks(stream: bytes, expected: Any) -> None:
    keys = [b"a", b"b"]
    assert reference(keys, stream) == expected
    for step in (0, 1, 3):
        assert parsed(keys, stream, step) == expected


def test_pack_get_heads_are_each_keys_line_prefix() -> None:
    request = pack_get([b"a", b"bc"])
    assert list(request.heads) == [b"VALUE a 0 ", b"VALUE bc 0 "]
    # keys are checked by the caller; a NUL in one must not shift the others' prefixes
    assert list(pack_get([b"a\x00b", b"c"]).heads) == [b"VALUE a\x00b 0 ", b"VALUE c 0 "]


memcached_keys = st.one_of(
    st.binary(max_size=260),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1,
            max_size=252).map(str.encode),
    st.sampled_from([b"ac#", b"ac#" + b"0" * 40, b"ac:ns:1", b"a b", b" ", b"", b"x" * 250,
                     b"x" * 251, b"ac:ns:ac#1"]),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(memcached_keys, max_size=12))
def test_safe_memcached_keys_maps_each_key_as_safe_memcached_key_does(
    keys: list[bytes]
) -> None:
    assert safe_memcached_keys(keys) == [safe_memcached_key(k) for k in keys]


def test_safe_memcached_keys_never_lets_a_space_or_an_empty_key_through() -> None:
    for keys in ([b"a b"], [b"a", b"b c", b"d"], [b"", b"a"], [b"a", b""], [b"a "],
                 [b"x" * 251], [b"a\tb"], [b"ac#1"]):
        assert safe_memcached_keys(keys) == [safe_memcached_key(k) for k in keys]
        assert safe_memcached_keys(keys) != keys


# -- large values received in place (a socket's parser, given ``alloc``) ------------------
def parsed_in_place(keys: list[bytes], stream: bytes, step: int, big: int = 4,
                    fed: bool = False) -> Any:
    """What a socket's ReplyParser (values of ``big`` bytes or more received into buffers
    of their own) makes of ``stream`` received ``step`` bytes at a time (0: as much as
    the buffer takes), through ``buffer()``/``received()`` as a socket does (``fed``:
    through ``feed()``, as an event loop that hands out ``bytes`` does)."""
    allocated: list[bytearray] = []

    def alloc(n: int) -> bytearray:
        allocated.append(bytearray(b"\xee" * n))  # garbage, not zeros: all overwritten
        return allocated[-1]

    parser = ReplyParser(MAX_VALUE, alloc=alloc, big=big)
    parser.expect(pack_get(keys))
    view = memoryview(stream)
    try:
        while True:
            reply = parser.gets()
            if reply is not False:
                break
            if not view:
                return INCOMPLETE
            room = parser.buffer()
            n = min(len(room), len(view), step or len(view))
            if fed:
                parser.feed(bytes(view[:n]))
            else:
                room[:n] = view[:n]
                parser.received(n)
            view = view[n:]
    except ProtocolViolation:
        return VIOLATION
    if isinstance(reply, list):
        for value in reply:  # a large value is one of the buffers, each its own
            if value is not None and len(value) >= big:
                assert any(value is buf for buf in allocated)
            elif value is not None:
                assert type(value) is bytes
        owned = [v for v in reply if v is not None and len(v) >= big]
        assert len({id(v) for v in owned}) == len(owned)
        return [None if v is None else bytes(v) for v in reply]
    return reply


@settings(max_examples=250, deadline=None)
@given(get_replies(), st.integers(min_value=0, max_value=17), st.sampled_from([1, 4, 16]),
       st.booleans())
def test_large_values_received_in_place_are_the_reference_values(
    case: tuple[list[bytes], bytes], step: int, big: int, fed: bool
) -> None:
    keys, stream = case
    expected = reference(keys, stream)
    assert parsed_in_place(keys, stream, step, big, fed) == expected
    for cut in range(len(stream)):  # every prefix: not complete yet, never a wrong value
        assert parsed_in_place(keys, stream[:cut], step, big, fed) in (INCOMPLETE, VIOLATION)


@settings(max_examples=1000, deadline=None)
@given(damaged(get_replies()), st.integers(min_value=0, max_value=17))
def test_damaged_replies_received_in_place_never_give_other_values(
    case: tuple[list[bytes], bytes], step: int
) -> None:
    """Damage is refused, or found later than whole parsing would (a value received in
    place is checked for its CRLF when it is complete), never read as other values."""
    keys, stream = case
    got = parsed_in_place(keys, stream, step)
    expected = reference(keys, stream)
    if isinstance(got, list):
        assert got == expected
    elif got == VIOLATION:  # the value's key or its CRLF checked when it is complete
        assert expected in (VIOLATION, INCOMPLETE)
    else:
        assert got == expected or expected == VIOLATION


def test_a_value_in_place_then_a_pipelined_reply_on_the_same_stream() -> None:
    big = b"B" * 70_000
    first, second = [b"k1", b"k2"], [b"k3"]
    stream = (b"VALUE k1 0 %d\r\n%s\r\nVALUE k2 0 2\r\nhi\r\nEND\r\n" % (len(big), big)
              + b"VALUE k3 0 3\r\nabc\r\nEND\r\n")
    allocated: list[Any] = []
    parser = ReplyParser(1 << 20, alloc=lambda n: allocated.append(bytearray(n)) or
                         allocated[-1])
    parser.expect(pack_get(first))
    parser.expect(pack_get(second))
    replies, view = [], memoryview(stream)
    while view:
        room = parser.buffer()
        n = min(len(room), len(view), 1000)
        room[:n] = view[:n]
        parser.received(n)
        view = view[n:]
        while (reply := parser.gets()) is not False:
            replies.append(reply)
    assert replies[0] == [big, b"hi"] and replies[0][0] is allocated[0]
    assert replies[1] == [b"abc"]
    assert len(allocated) == 1 and parser.buffered == 0 and parser.waiting == 0
