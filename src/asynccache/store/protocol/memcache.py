"""memcached's text protocol without I/O: requests to send, a parser for what comes back.

Why it is built this way: docs/design.md, "memcached's text protocol".
"""

from __future__ import annotations

import collections
import hashlib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ...errors import StoreError, StoreTimeout, StoreUnavailable

__all__ = [
    "DELETED",
    "MAX_LINE",
    "NOT_FOUND",
    "STORED",
    "VERSION",
    "ErrorReply",
    "ProtocolViolation",
    "Reply",
    "ReplyParser",
    "Request",
    "ValueOverBound",
    "explain_rejection",
    "hashed_prefix",
    "meta_size",
    "no_answer",
    "not_understood",
    "pack_delete",
    "pack_exists",
    "pack_get",
    "pack_set",
    "pack_size",
    "safe_memcached_key",
    "safe_memcached_keys",
    "unexpected_reply",
]

#: Longest reply line accepted (a ``VALUE`` line is at most ~300 bytes with a 250-byte key).
MAX_LINE = 8192
#: What a blocking connection receives into, per ``recv_into``.
INBOX = 1 << 18
#: Values of at least this many bytes are received into memory of their own (a parser
#: given ``alloc``), never copied out of the stream's buffer.
BIG_VALUE = 64 << 10

STORED = b"STORED"
NOT_FOUND = b"NOT_FOUND"
DELETED = b"DELETED"

_SAFE_KEY = re.compile(rb"(?!ac#)[\x21-\x7e]{1,250}")
#: Keys joined by spaces, with a space after the last, each of which _SAFE_KEY takes.
_SAFE_KEYS = re.compile(rb"(?:(?!ac#)[\x21-\x7e]{1,250} )+")
#: A key already in its digest form (as listed back from a server): mapped to itself.
_HASHED_KEY = re.compile(rb"ac#[0-9a-f]{40}")
_MAX_KEY = 250
_DIGEST_HEX = 40
_STORAGE_WORDS = frozenset({STORED, b"NOT_STORED", b"EXISTS", NOT_FOUND})
_DELETE_WORDS = frozenset({DELETED, NOT_FOUND})
#: meta get replies: found (``HD``; ``OK`` before memcached 1.6.10), not found (``EN``)
_META_WORDS = frozenset({b"HD", b"OK", b"EN"})
_ERROR_WORDS = (b"SERVER_ERROR", b"CLIENT_ERROR", b"ERROR")
#: The rest of a get reply is split in one pass when its first value is at most this big
#: (scanning values for CRLF costs more than reading their lines one by one beyond it),
#: looking for its END within the next _BULK_SCAN bytes.
_BULK_VALUE = 512
_BULK_SCAN = 1 << 16


def safe_memcached_key(key: bytes) -> bytes:
    """``key`` itself when memcached accepts it, else a fixed-length digest form of it.

    memcached takes 1–250 bytes of printable ASCII without spaces. Any other key (too
    long, whitespace, control characters, non-ASCII) becomes a digest that keeps the
    key's namespace prefix, so ``asynccache stats`` / ``flush`` still find it by prefix:

    * ``ac:<ns>:`` + ``#`` + ``blake2b(key).hexdigest()`` for a key of asynccache's
      scheme (``ac:<ns>:...``) whose prefix is itself a short memcached key;
    * ``ac%`` + ``blake2b(prefix)[:8 bytes]`` + ``:#`` + digest when that prefix is not
      (a non-ASCII or very long namespace): see `hashed_prefix()`;
    * ``ac#`` + digest for any other key.

    No key asynccache writes has ``#`` right after its namespace prefix (encoded keys start
    with a digit, ``-`` or a tag letter), so the first two forms never meet a key stored
    verbatim. Keys that start with ``ac#`` are hashed too, except the exact ``ac#`` + 40 hex
    digits form: a key listed back from the server maps to itself, which is what lets
    `MemcachedClient.scan()` hand its keys to ``delete_many``. (Only a key crafted to equal
    another key's digest could collide.)
    """
    if _SAFE_KEY.fullmatch(key) or _HASHED_KEY.fullmatch(key):
        return key
    digest = hashlib.blake2b(key, digest_size=_DIGEST_HEX // 2).hexdigest().encode()
    prefix = _namespace_prefix(key)
    return (b"ac#" if prefix is None else hashed_prefix(prefix)) + digest


def safe_memcached_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``[safe_memcached_key(k) for k in keys]``, in one pass over all of them when every
    key is already one memcached takes (asynccache's own keys are): one regular expression
    over the keys joined by spaces. A key with a space inside would read as two keys, so
    the spaces are counted too: one after each key, none within."""
    line = b" ".join(keys) + b" "
    if line.count(b" ") == len(keys) and _SAFE_KEYS.fullmatch(line) is not None:
        return list(keys)
    return [safe_memcached_key(k) for k in keys]


def _namespace_prefix(key: bytes) -> bytes | None:
    """``ac:<ns>:`` of a key of asynccache's scheme, else None."""
    if not key.startswith(b"ac:"):
        return None
    end = key.find(b":", 3)
    return None if end < 0 else key[:end + 1]


def hashed_prefix(prefix: bytes) -> bytes:
    """What the digest forms of the keys under ``prefix`` (``ac:<ns>:``) start with."""
    if _SAFE_KEY.fullmatch(prefix) and len(prefix) + 1 + _DIGEST_HEX <= _MAX_KEY:
        return prefix + b"#"
    return b"ac%" + hashlib.blake2b(prefix, digest_size=8).hexdigest().encode() + b":#"


class ProtocolViolation(ValueError):
    """The server sent something no pending request can be answered with (``line``: the
    reply line that could not be one, when that is what went wrong)."""

    def __init__(self, message: str, line: bytes | None = None) -> None:
        super().__init__(message)
        self.line = line


class ValueOverBound(ProtocolViolation):
    """A ``VALUE`` announced larger than any value asynccache writes (``item_size``)."""


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """``SERVER_ERROR …``, ``CLIENT_ERROR …`` or ``ERROR``: the server's refusal, as a value.

    After a ``SERVER_ERROR`` the stream is in sync (memcached discards the refused
    value's bytes); after ``CLIENT_ERROR``/``ERROR`` it may not be (the server may have
    read a value's bytes as a command), so a connection should not be reused.
    """

    kind: bytes
    message: str

    @property
    def in_sync(self) -> bool:
        return self.kind == b"SERVER_ERROR"

    def __str__(self) -> str:
        return f"{self.kind.decode()} {self.message}".rstrip()


#: A parsed reply: a get's values (aligned with its keys, ``None`` where absent), a
#: one-line status (``b"STORED"``, ``b"VERSION 1.6.21"``, ...), or an error.
#: one value of a get reply: bytes, or a large value's own buffer (a parser given alloc)
Value = bytes | bytearray | memoryview
Reply = list[Value | None] | bytes | ErrorReply


@dataclass(frozen=True, slots=True)
class Request:
    """One command: the buffers to send (written back to back, values not copied) and
    what its reply must be: a get's keys, or the first words a one-line reply may have.
    A get also carries, per key, how the line of its hit starts when the value has flags
    0 and no cas (``VALUE <key> 0 ``): the parser's fast path compares whole prefixes."""

    buffers: tuple[bytes | memoryview, ...]
    keys: tuple[bytes, ...] | None = None
    accepts: frozenset[bytes] = frozenset()
    heads: Sequence[bytes] = ()


def pack_get(keys: Sequence[bytes]) -> Request:
    """``get k1 k2 …``; ``keys`` must be valid (see `safe_memcached_key()`) and unique."""
    if not keys:
        raise ValueError("a get needs at least one key")
    # valid keys hold no NUL: one join and one split make every key's line prefix
    heads = (b"VALUE " + b" 0 \0VALUE ".join(keys) + b" 0 ").split(b"\0")
    if len(heads) != len(keys):
        heads = [b"VALUE %s 0 " % key for key in keys]
    return Request((b"get " + b" ".join(keys) + b"\r\n",), tuple(keys), heads=heads)


def pack_set(key: bytes, value: bytes | memoryview, exptime: int, flags: int = 0) -> Request:
    """``set key flags exptime bytes`` then the value, as three buffers."""
    size = memoryview(value).nbytes
    head = b"set %s %d %d %d\r\n" % (key, flags, exptime, size)
    return Request((head, value, b"\r\n"), accepts=_STORAGE_WORDS)


def pack_add(key: bytes, value: bytes, exptime: int) -> Request:
    """``add``: store only if the key is absent (``STORED``), else ``NOT_STORED``."""
    head = b"add %s 0 %d %d\r\n" % (key, exptime, len(value))
    return Request((head, value, b"\r\n"), accepts=_STORAGE_WORDS)


def pack_delete(key: bytes) -> Request:
    return Request((b"delete %s\r\n" % key,), accepts=_DELETE_WORDS)


def pack_exists(key: bytes) -> Request:
    """``mg key``: ``HD`` when the key is there, ``EN`` when not; no value is sent."""
    return Request((b"mg %s\r\n" % key,), accepts=_META_WORDS)


def pack_size(key: bytes) -> Request:
    """``mg key s``: ``HD s<value size>`` when the key is there, ``EN`` when not."""
    return Request((b"mg %s s\r\n" % key,), accepts=_META_WORDS)


def meta_size(reply: bytes) -> int | None:
    """The value size in an ``mg ... s`` reply; None for ``EN`` (the key is gone)."""
    for flag in reply.split(b" ")[1:]:
        if flag.startswith(b"s") and flag[1:].isdigit():
            return int(flag[1:])
    return None


VERSION = Request((b"version\r\n",), accepts=frozenset({b"VERSION"}))


def _error_reply(line: bytes) -> ErrorReply | None:
    word, _, rest = line.partition(b" ")
    if word in _ERROR_WORDS:
        return ErrorReply(word, rest.decode("utf-8", "replace"))
    return None


class ReplyParser:
    """Incremental parser of a pipelined stream of replies, checked against requests.

    Call `expect()` with each request as it is sent, `feed()` with whatever
    bytes arrived (or `buffer()` / `received()`), then `gets()` until it
    returns False (`next()`: ``None``; the next reply is not complete yet). Raises
    `ProtocolViolation` for anything that cannot be the reply to the oldest
    request still waiting.
    """

    __slots__ = ("_alloc", "_avail", "_big", "_buf", "_chunks", "_crlf_due", "_cursor",
                 "_expected", "_filled", "_inbox", "_index", "_max_value", "_need", "_pos",
                 "_target", "_values")

    def __init__(self, max_value: int,
                 alloc: Callable[[int], bytearray | memoryview] | None = None,
                 big: int = BIG_VALUE) -> None:
        self._max_value = max_value
        #: given (a socket's parser), a value of at least ``big`` bytes is received
        #: into ``alloc(size)`` and handed out as that buffer, the caller's alone
        self._alloc = alloc
        self._big = max(big, 1) if alloc is not None else sys.maxsize
        self._target: bytearray | memoryview | None = None  # a value arriving in place
        self._filled = 0
        self._crlf_due = False  # the CRLF after a value received in place is to be read
        self._expected: collections.deque[Request] = collections.deque()
        self._buf = b""      # bytes being parsed, from _pos on
        self._pos = 0
        self._chunks: list[bytes] = []  # fed since the last join
        self._avail = 0      # unparsed bytes: len(_buf) - _pos + those in _chunks
        self._need = 1       # no parse is attempted before _avail reaches this
        # the get reply in progress (the oldest request's): values so far, next position
        self._values: list[Value | None] | None = None
        self._cursor = 0
        self._index: dict[bytes, int] | None = None
        self._inbox: memoryview | None = None  # what a socket receives into (buffer())

    @property
    def waiting(self) -> int:
        """Requests whose replies have not been parsed yet."""
        return len(self._expected)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed into a reply."""
        return self._avail

    def expect(self, request: Request) -> None:
        self._expected.append(request)

    def feed(self, data: bytes | memoryview) -> None:
        """Copy ``data`` in: the bytes of a large value arriving in place go into its own
        buffer, as `buffer()`/`received()` would have put them."""
        view = memoryview(data)
        while self._target is not None and view:
            room = self.buffer()
            n = min(len(room), len(view))
            room[:n] = view[:n]
            self.received(n)
            view = view[n:]
        if view:
            self._chunks.append(bytes(view))
            self._avail += len(view)

    def buffer(self) -> memoryview:
        """Where a socket receives the next bytes (reused: ``recv(n)`` would allocate
        ``n`` bytes per call; a large value's own memory while it arrives); then
        `received()`."""
        target = self._target
        if target is not None:
            return memoryview(target)[self._filled:]
        if self._inbox is None:
            self._inbox = memoryview(bytearray(INBOX))
        return self._inbox

    def received(self, n: int) -> None:
        target = self._target
        if target is not None:
            self._filled += n
            if self._filled == len(target):  # complete: its CRLF comes next
                self._target = None
                self._need = 2
            return
        assert self._inbox is not None
        self.feed(self._inbox[:n])  # values are sliced out of bytes, not views

    def next(self) -> Reply | None:
        """The oldest request's reply if it has fully arrived, else ``None``."""
        reply = self.gets()
        return None if reply is False else reply

    def gets(self) -> Reply | Literal[False]:
        """The oldest request's reply if it has fully arrived, else False."""
        if not self._expected:
            if self._avail:
                raise ProtocolViolation(f"{self._avail} bytes arrived that no request asked for")
            return False
        if self._target is not None or self._avail < self._need:
            return False
        self._join()
        request = self._expected[0]
        reply = self._get_reply(request) if request.keys is not None \
            else self._line_reply(request.accepts)
        if reply is None:
            return False
        self._expected.popleft()
        self._need = 1
        if self._pos == len(self._buf):  # do not keep a large reply's buffer alive
            self._buf, self._pos = b"", 0
        return reply

    # -- internals ----------------------------------------------------------------------
    def _join(self) -> None:
        if self._chunks:
            rest = self._buf[self._pos:] if self._pos < len(self._buf) else b""
            self._buf = b"".join([rest, *self._chunks]) if rest else b"".join(self._chunks)
            self._pos = 0
            self._chunks = []

    def _advance(self, pos: int) -> None:
        self._avail -= pos - self._pos
        self._pos = pos

    def _incomplete_line(self, pending: int) -> None:
        """``pending`` bytes and no ``\\r\\n`` yet: wait for one more byte, up to a bound."""
        if pending > MAX_LINE:
            raise ProtocolViolation(f"a reply line of over {MAX_LINE} bytes without CRLF")
        self._need = pending + 1

    def _line_reply(self, accepts: frozenset[bytes]) -> bytes | ErrorReply | None:
        eol = self._buf.find(b"\r\n", self._pos)
        if eol < 0:
            self._incomplete_line(len(self._buf) - self._pos)
            return None
        line = self._buf[self._pos:eol]
        self._advance(eol + 2)
        if line.partition(b" ")[0] in accepts:
            return line
        error = _error_reply(line)
        if error is None:
            raise ProtocolViolation(f"unexpected reply {line[:80]!r}", line)
        return error

    def _get_reply(self, request: Request) -> list[Value | None] | ErrorReply | None:
        """The hot loop (one pass per ``VALUE``), on locals; the position, the cursor and
        the bytes consumed are written back once, however it ends.

        Fast path: the next key's hit with flags 0 and no cas, complete in the buffer
        (what memcached sends for asynccache's own values, in request order): its line
        is compared with the key's known prefix as a whole and only the size is read.
        Anything else (another key, flags, a cas, a line or value still arriving, a
        malformed line, ``END``, an error) takes the general path, which checks every
        field and is the one that raises."""
        keys, heads = request.keys, request.heads
        assert keys is not None
        values = self._values
        if values is None:
            values = self._values = [None] * len(keys)
            self._cursor, self._index = 0, None
        buf, pos, cursor = self._buf, self._pos, self._cursor
        n_keys, n_buf, max_value = len(keys), len(buf), self._max_value
        n_heads, big = len(heads), self._big
        startswith, find = buf.startswith, buf.find
        bulk_tried = False
        try:
            if self._crlf_due:  # after a value received in place
                if n_buf - pos < 2:
                    self._need = 2
                    return None
                if not startswith(b"\r\n", pos):
                    raise ProtocolViolation("a value received in place is not followed by CRLF")
                pos += 2
                self._crlf_due = False
            while True:
                if cursor < n_heads:
                    head = heads[cursor]
                    if startswith(head, pos):
                        start = pos + len(head)
                        eol = find(b"\r\n", start, start + 12)  # <= 10 digits
                        if eol > start:
                            digits = buf[start:eol]
                            if digits.isdigit():
                                size = int(digits)
                                end = eol + 2 + size
                                if size <= max_value and end + 2 <= n_buf \
                                        and startswith(b"\r\n", end):
                                    values[cursor] = buf[eol + 2:end] if size < big \
                                        else self._own(buf, eol + 2, size)
                                    cursor += 1
                                    pos = end + 2
                                    if size <= _BULK_VALUE and cursor < n_heads - 1 \
                                            and not bulk_tried:
                                        bulk_tried = True
                                        done = _bulk_hits(buf, pos, heads, cursor, values,
                                                          max_value)
                                        if done >= 0:
                                            cursor, pos = n_heads, done
                                    continue
                eol = find(b"\r\n", pos)
                if eol < 0:
                    self._incomplete_line(n_buf - pos)
                    return None
                if not startswith(b"VALUE ", pos):
                    break
                header = buf[pos + 6:eol].split(b" ")  # key flags bytes [cas]
                if len(header) not in (3, 4) or not header[2].isdigit():
                    raise ProtocolViolation(f"malformed VALUE line {buf[pos:eol][:80]!r}")
                size = int(header[2])
                if size > max_value:
                    raise ValueOverBound(f"a VALUE of {size} bytes announced, over the "
                                         f"{max_value}-byte bound")
                key = header[0]
                end = eol + 2 + size
                if end + 2 > n_buf:
                    if size < big:
                        self._need = end + 2 - pos
                        return None
                    # a large value still arriving: the rest goes straight into its own
                    # buffer (buffer()), then its CRLF is read
                    i = cursor if cursor < n_keys and keys[cursor] == key else \
                        self._position(keys, key)
                    have = min(n_buf - (eol + 2), size)
                    values[i] = target = self._own(buf, eol + 2, have, size)
                    cursor = i + 1
                    pos = eol + 2 + have
                    self._crlf_due = True
                    if have < size:
                        self._target, self._filled = target, have
                    else:
                        self._need = 2
                    return None
                if buf[end:end + 2] != b"\r\n":
                    raise ProtocolViolation(f"value of {size} bytes not followed by CRLF")
                # memcached answers hits in request order: the next position first
                i = cursor if cursor < n_keys and keys[cursor] == key else \
                    self._position(keys, key)
                values[i] = buf[eol + 2:end] if size < big else self._own(buf, eol + 2, size)
                cursor = i + 1
                pos = end + 2
        finally:
            self._avail -= pos - self._pos
            self._pos, self._cursor = pos, cursor
        line = buf[pos:eol]
        self._advance(eol + 2)
        self._values = None
        if line == b"END":
            return values
        error = _error_reply(line)
        if error is None:
            raise ProtocolViolation(f"unexpected line {line[:80]!r} in a get reply", line)
        return error

    def _own(self, buf: bytes, start: int, n: int, size: int | None = None
             ) -> bytearray | memoryview:
        """A buffer of its own for a large value of ``size`` (default ``n``) bytes, with
        the ``n`` of them that are in ``buf`` from ``start`` copied in."""
        assert self._alloc is not None
        target = self._alloc(n if size is None else size)
        target[:n] = memoryview(buf)[start:start + n]
        return target

    def _position(self, keys: tuple[bytes, ...], key: bytes) -> int:
        """Where a value that came out of order goes; a key not asked is a violation."""
        if self._index is None:
            self._index = {k: n for n, k in enumerate(keys)}
        found = self._index.get(key)
        if found is None:
            raise ProtocolViolation(f"a value for {key[:80]!r}, which was not asked for")
        return found


def _bulk_hits(buf: bytes, pos: int, heads: Sequence[bytes], cursor: int,
                values: list[Value | None], max_value: int) -> int:
    """The rest of a get reply of small values in one pass, when it is what memcached
    sends for all-hits: the plain hit of every key from ``cursor`` on, in order, then
    ``END``. Fills ``values`` and returns where ``END`` starts, or -1 (nothing changed).

    ``buf[pos:]`` is cut at CRLF up to the first ``CRLF END CRLF``; it is taken only when
    the pieces alternate exactly ``VALUE <key> 0 <len(next piece)>`` and that piece, key
    by key. Then reading the lines one by one from ``pos`` would find the same values:
    each line announces the length of the piece after it, and the CRLF that ends it.
    (A value holding CRLF, a miss, flags or a cas only make this refuse.)
    """
    end = buf.find(b"\r\nEND\r\n", pos, pos + _BULK_SCAN)
    if end < 0:
        return -1
    pieces = buf[pos:end].split(b"\r\n")
    rest = heads[cursor:]
    if len(pieces) != 2 * len(rest):
        return -1
    found = pieces[1::2]
    if max(map(len, found)) > max_value:
        return -1
    if pieces[0::2] != list(map(bytes.__add__, rest, map(b"%d".__mod__, map(len, found)))):
        return -1
    values[cursor:] = found
    return end + 2


# -- what replies (and silences) mean, for both connections ------------------------------
def no_answer(where: str, timeout: float) -> StoreTimeout:
    return StoreTimeout(f"memcached {where} did not answer within {timeout:g}s; "
                        "raise `timeout=` in connect() if the store is just slow")


#: the first bytes of RESP replies (simple string, error, integer, bulk, array): never the
#: first byte of a memcached reply line, which starts with a word in capitals
_RESP_STARTS = frozenset(b"+-:$*")


def unexpected_reply(where: str, exc: ProtocolViolation) -> StoreError:
    """What a reply that cannot answer the request means. A Redis server answers memcached's
    text commands in RESP (``-ERR unknown command``, ``$-1``): that is the wrong URL --
    a ``StoreUnavailable`` (the node is backed off) saying which URL to use. A value over
    the bound: the server's item size is larger than ``item_size``. Otherwise the stream
    cannot be trusted. The connection is closed in every case."""
    line = exc.line
    if line and line[0] in _RESP_STARTS:
        return StoreUnavailable(
            f"memcached {where}: this looks like a Redis server, not memcached (it answered "
            f"{line[:60]!r}, a RESP reply): use redis://{where}/0 (or point memcached:// at "
            "a memcached port)")
    if isinstance(exc, ValueOverBound):
        return StoreError(f"memcached {where} sent an unexpected reply ({exc}); the "
                          "connection was closed. A value over twice item_size is not one "
                          "asynccache wrote: pass the server's -I as item_size= to connect() "
                          "if it is larger")
    return StoreError(f"memcached {where} sent an unexpected reply ({exc}); the connection "
                      "was closed")


def not_understood(where: str, reply: ErrorReply) -> StoreError:
    return StoreError(f"memcached {where} did not understand a request ({reply}); the "
                      "connection was closed (its stream can no longer be trusted)")


def explain_rejection(reply: Reply, where: str, size: int) -> str:
    """What a refused ``set`` means, and which server setting to change."""
    text = str(reply) if isinstance(reply, ErrorReply) else repr(reply)
    if "too large" in text:
        return (f"memcached {where} refused a {size}-byte value ({text}): it is over the "
                "server's item size; start memcached with a larger -I, or pass item_size= "
                "to connect() so asynccache chunks values below the server's limit")
    if "out of memory" in text:
        return (f"memcached {where} is full and refuses writes ({text}): either it runs "
                "with -M (no eviction) and its memory is used up, or its memory went to "
                "values of other sizes and none of this size is there to evict; drop -M "
                "(a cache should evict), raise -m, or start it with "
                "-o slab_reassign,slab_automove=2 so memory moves to the sizes written")
    return f"memcached {where} refused a {size}-byte value: {text}"
