"""``MGET`` replies parsed in Python, large values received in place (no I/O here).

Why it is built this way: docs/design.md, "Large values in place".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hiredis

__all__ = ["BIG_VALUE", "MAX_LINE", "MAX_VALUE", "BulkReader", "ProtocolError", "ValueSizes"]

#: values of at least this many bytes are received into their own buffer
BIG_VALUE = 64 << 10
#: the largest value a reply may claim (Redis' own proto-max-bulk-len default)
MAX_VALUE = 512 << 20
#: longest header line accepted (``$`` + a 20-digit length + CRLF fits many times over)
MAX_LINE = 512
_BUFFER = 256 << 10
_CRLF = b"\r\n"


class ValueSizes:
    """Which parser a connection's ``MGET`` replies want: an estimate of the replies'
    first values (the newest weighs half; one look per reply), large from ``BIG_VALUE``
    on and small again only below a quarter of it, so that values near the line do not
    switch parsers back and forth."""

    __slots__ = ("estimate",)

    def __init__(self) -> None:
        self.estimate = 0.0

    def observe(self, values: Sequence[Any]) -> None:
        if values and (first := values[0]) is not None:
            self.estimate += 0.5 * (len(first) - self.estimate)

    def big(self, now: bool) -> bool:
        """Whether `BulkReader` should read the replies, given whether it ``now`` does."""
        return self.estimate >= (BIG_VALUE // 4 if now else BIG_VALUE)


class ProtocolError(Exception):
    """The server sent something that is not an ``MGET`` reply (nor a status, an integer
    or an error)."""


class BulkReader:
    """Incremental parser of ``MGET`` replies: ``buffer()``/``received(n)`` (or
    ``feed``), then ``gets()`` until it returns False; docs/design.md has the details."""

    __slots__ = ("_buf", "_count", "_end", "_filled", "_items", "_size", "_start",
                 "_target", "_view", "alloc", "big", "max_items", "max_value")

    def __init__(self, *, big: int = BIG_VALUE, max_value: int = 1 << 40,
                 max_items: int = 1 << 24,
                 alloc: Callable[[int], bytearray | memoryview] = bytearray) -> None:
        self.alloc = alloc
        self.big = big
        self.max_value = max_value
        self.max_items = max_items
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # unparsed bytes are _buf[_start:_end]
        self._end = 0
        self._items: list[Any] | None = None  # the array being read, None between replies
        self._count = 0
        self._size = -2  # length of the bulk string whose header was read (-2: none)
        self._target: Any = None  # a big value being received in place (alloc's buffer)
        self._filled = 0

    # -- bytes in -------------------------------------------------------------------------
    def buffer(self) -> memoryview:
        """Where the next bytes from the socket go (never empty)."""
        target = self._target
        if target is not None and self._filled < len(target):
            return memoryview(target)[self._filled:]
        if self._end == len(self._buf):
            self._make_room()
        return self._view[self._end:]

    def received(self, n: int) -> None:
        """``n`` bytes were written into the last `buffer()`."""
        target = self._target
        if target is not None and self._filled < len(target):
            self._filled += n
        else:
            self._end += n

    def feed(self, data: bytes) -> None:
        """Copy ``data`` in (tests, and bytes that were read before this reader existed)."""
        view = memoryview(data)
        while view:
            room = self.buffer()
            n = min(len(room), len(view))
            room[:n] = view[:n]
            self.received(n)
            view = view[n:]

    @property
    def idle(self) -> bool:
        """No reply is half read and no byte waits to be parsed."""
        return self._items is None and self._start == self._end and self._target is None

    def _make_room(self) -> None:
        """Move the unparsed tail to the front, or grow (a long run of small values)."""
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = 0
            return
        if start > 0 and end - start <= len(self._buf) // 2:
            self._buf[: end - start] = self._view[start:end]
        else:
            grown = bytearray(2 * len(self._buf))
            grown[: end - start] = self._view[start:end]
            self._view.release()
            self._buf, self._view = grown, memoryview(grown)
        self._start, self._end = 0, end - start

    # -- replies out ----------------------------------------------------------------------
    def gets(self) -> Any:
        """The next complete reply, else False: a list (an ``MGET``'s), a
        ``hiredis.ReplyError``, or as hiredis gives them a status (``bytes``: the
        ``+OK`` of ``AUTH``/``SELECT``, ``+PONG``) or an integer."""
        if self._items is None:
            line = self._line()
            if line is None:
                return False
            kind = line[:1]
            if kind == b"-":
                return hiredis.ReplyError(bytes(line[1:]).decode("utf-8", "replace"))
            if kind == b"+":
                return bytes(line[1:])
            if kind == b":":
                return self._number(line)
            if kind != b"*":
                raise ProtocolError(f"expected an array reply, got {bytes(line[:40])!r}")
            count = self._number(line)
            if count < 0:
                raise ProtocolError("a nil array is not an MGET reply")
            if count > self.max_items:
                raise ProtocolError(f"an array of {count} elements is over the limit")
            self._items, self._count = [], count
        items = self._items
        assert items is not None
        while len(items) < self._count:
            value = self._element()
            if value is False:
                return False
            items.append(value)
        self._items = None
        if self._start == self._end:
            self._start = self._end = 0
        return items

    def _element(self) -> Any:
        """The next element of the array: bytes, ``alloc``'s buffer (big: memory of that
        value's own, never touched again by this reader), None, or False (wait)."""
        target = self._target
        if target is not None:
            if self._filled < len(target):
                self._fill_from_buffer(target)
                if self._filled < len(target):
                    return False
            if self._end - self._start < 2:
                return False
            self._expect_crlf()
            self._target = None
            return target
        size = self._size
        if size == -2:
            line = self._line()
            if line is None:
                return False
            if line[:1] != b"$":
                raise ProtocolError(f"expected a bulk string, got {bytes(line[:40])!r}")
            size = self._number(line)
            if size < 0:
                return None
            if size > self.max_value:
                raise ProtocolError(f"a value of {size} bytes is over the limit")
            if size >= self.big and self._end - self._start < size + 2:
                self._target, self._filled = self.alloc(size), 0
                return self._element()
            self._size = size
        start = self._start
        if self._end - start < size + 2:
            return False
        value: bytes | bytearray | memoryview
        if size >= self.big:  # arrived with the headers: still a buffer of its own
            value = self.alloc(size)
            value[:] = self._view[start:start + size]
        else:
            value = bytes(self._view[start:start + size])
        self._start = start + size
        self._expect_crlf()
        self._size = -2
        return value

    def _fill_from_buffer(self, target: Any) -> None:
        """Bytes of a big value that came with the headers move into its buffer."""
        have = self._end - self._start
        if not have:
            return
        n = min(have, len(target) - self._filled)
        target[self._filled:self._filled + n] = self._view[self._start:self._start + n]
        self._filled += n
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0

    def _expect_crlf(self) -> None:
        start = self._start
        if self._view[start:start + 2] != _CRLF:
            raise ProtocolError("a bulk string is not followed by CRLF")
        self._start = start + 2

    def _line(self) -> memoryview | None:
        """The next header line without its CRLF, or None if it is not complete."""
        start, end = self._start, self._end
        at = self._buf.find(_CRLF, start, min(end, start + MAX_LINE))
        if at < 0:
            if end - start >= MAX_LINE:
                raise ProtocolError(f"a header line longer than {MAX_LINE} bytes")
            return None
        self._start = at + 2
        return self._view[start:at]

    @staticmethod
    def _number(line: memoryview) -> int:
        digits = bytes(line[1:])
        if not digits or not (digits.isdigit() or (digits[:1] == b"-" and digits[1:].isdigit())):
            raise ProtocolError(f"not a length: {bytes(line[:40])!r}")
        return int(digits)
