"""RESP (Redis/Valkey) requests and replies for the lean read path; parsing is hiredis'.

Why only this much: reads on the hot path are ``MGET`` (a single server) or, on a cluster,
pipelined ``GET``s per node (``MGET`` for a slot holding several keys of the batch), and
each connection first sends ``AUTH``/``SELECT``. The cluster topology is redis-py's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import hiredis

from ...errors import StoreError, StoreUnavailable

__all__ = [
    "RespParser",
    "check_mget_reply",
    "cluster_node_error",
    "memcached_hint",
    "no_permission",
    "pack_command",
    "pack_gets",
    "pack_mget",
    "setup_commands",
    "setup_refused",
    "unexpected_reply",
]


#: What a blocking connection receives into, per ``recv_into``.
INBOX = 1 << 18


class RespParser:
    """hiredis' reply parser, fed either way: ``feed(bytes)`` (asyncio), or
    ``buffer()`` / ``received(n)`` (a socket receives into a buffer reused for the
    connection's life); then ``gets()`` until it returns False."""

    __slots__ = ("_inbox", "_parser", "_view", "feed", "gets")

    def __init__(self) -> None:
        self._parser = hiredis.Reader()
        self.feed = self._parser.feed
        self.gets = self._parser.gets
        self._inbox: bytearray | None = None
        self._view: memoryview | None = None

    def buffer(self) -> memoryview:
        if self._view is None:
            self._inbox = bytearray(INBOX)
            self._view = memoryview(self._inbox)
        return self._view

    def received(self, n: int) -> None:
        self._parser.feed(self._inbox, 0, n)  # type: ignore[arg-type]  # any buffer

    @property
    def idle(self) -> bool:
        """No byte waits to be parsed."""
        return not self._parser.has_data()


def pack_command(*args: bytes) -> bytes:
    """RESP encoding of one command whose arguments are already bytes."""
    parts = [b"*%d\r\n" % len(args)]
    parts.extend(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    return b"".join(parts)


def pack_mget(keys: Sequence[bytes]) -> bytes:
    """``MGET keys``; keys of one length (most batches: indices with as many digits)
    are framed with one join, ~5x faster than one format per key."""
    if keys and len(set(map(len, keys))) == 1:
        size = len(keys[0])
        return b"".join((b"*%d\r\n$4\r\nMGET\r\n$%d\r\n" % (len(keys) + 1, size),
                         (b"\r\n$%d\r\n" % size).join(keys), b"\r\n"))
    return b"".join([b"*%d\r\n$4\r\nMGET\r\n" % (len(keys) + 1),
                     *[b"$%d\r\n%s\r\n" % (len(k), k) for k in keys]])


def pack_gets(keys: Sequence[bytes]) -> bytes:
    """One ``GET`` per key, back to back: one reply per key, in order."""
    if len(set(map(len, keys))) == 1:  # keys of one length (most batches): one join
        head = b"*2\r\n$3\r\nGET\r\n$%d\r\n" % len(keys[0])
        return b"".join((head, (b"\r\n" + head).join(keys), b"\r\n"))
    return b"".join([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys])


def setup_commands(username: str | None, password: str | None, db: int) -> list[bytes]:
    """``AUTH`` and ``SELECT`` a new connection needs, packed (empty when none)."""
    setup = []
    if password is not None:
        user = (username.encode(),) if username else ()
        setup.append(pack_command(b"AUTH", *user, password.encode()))
    if db:
        setup.append(pack_command(b"SELECT", str(db).encode()))
    return setup


def setup_refused(where: str, replies: Sequence[Any]) -> StoreUnavailable | None:
    """The error to raise when the server refused a setup command, else None."""
    for reply in replies:
        if isinstance(reply, hiredis.ReplyError):
            return StoreUnavailable(f"redis {where} refused the credentials or database: "
                                    f"{reply}; check the user and password in the URL (or "
                                    "password_env) and the db")
    return None


def no_permission(text: str, where: str) -> str:
    """What a ``NOPERM`` reply means: the ACL user may not touch these keys, or run this
    command; and what to grant it."""
    return (f"redis {where}: the ACL user lacks permission ({text}); asynccache uses the "
            "keys ac:<namespace>:* with MGET (and GET on a cluster), SET, DEL and PING: grant "
            "the user that key pattern and those commands, e.g. ACL SETUSER <user> "
            "~ac:<namespace>:* +mget +get +set +del +ping")


#: what an element of an MGET reply may be: a value (hiredis: bytes; the bulk reader: a
#: buffer of its own) or a miss
_VALUE_TYPES = frozenset({bytes, bytearray, memoryview, type(None)})


def check_mget_reply(reply: Any, where: str, count: int) -> list[Any]:
    """The values of an ``MGET`` of ``count`` keys; an error reply, or an array that is
    not one value or nil per key (a garbled reply: one element too many, error elements
    inside the array as some fan-out proxies send), becomes a StoreError: the keys are
    then misses, never values paired with the wrong key or an exception in a read."""
    if isinstance(reply, list):
        if len(reply) == count and set(map(type, reply)) <= _VALUE_TYPES:
            return reply
        raise StoreError(f"redis {where} sent a garbled MGET reply ({_garbled(reply, count)}); "
                         "its keys are read as misses")
    if isinstance(reply, hiredis.ReplyError):
        text = str(reply)
        if text.startswith("NOPERM"):
            return_error: StoreError = StoreUnavailable(no_permission(text, where))
        elif text.startswith(("LOADING", "BUSY", "MASTERDOWN", "NOAUTH")):
            return_error = StoreUnavailable(f"redis {where} cannot serve reads: {text}")
        else:
            return_error = StoreError(f"redis {where} answered MGET with an error: {text}")
        raise return_error
    raise StoreError(f"redis {where} answered MGET with {type(reply).__name__}, not an array")


def _garbled(reply: list[Any], count: int) -> str:
    if len(reply) != count:
        return f"{len(reply)} elements for {count} keys"
    odd = next(v for v in reply if type(v) not in _VALUE_TYPES)
    return f"an element that is a {type(odd).__name__}: {str(odd)[:80]!r}"


#: Error replies that mean "this cluster node cannot serve these keys now", not "this value".
_UNAVAILABLE = ("CLUSTERDOWN", "LOADING", "BUSY", "MASTERDOWN", "NOAUTH")


def cluster_node_error(reply: Any, node: str) -> StoreError | None:
    """The failure an error reply of a cluster node means for its keys, or None for a
    reply about the command itself (a refused value, a wrong type) or a redirection."""
    text = str(reply)
    if text.startswith("TRYAGAIN"):
        # a multi-key command on a slot half migrated: transient, no back-off
        return StoreError(f"redis cluster node {node} answered {text}: its slot is being "
                          "migrated and those keys are split between two nodes for now")
    if text.startswith("NOPERM"):
        return StoreUnavailable(no_permission(text, f"cluster node {node}"))
    if text.startswith(_UNAVAILABLE):
        hint = ""
        if text.startswith("CLUSTERDOWN"):
            hint = ("; if a node is down, set cluster-require-full-coverage no on every "
                    "node so the others keep serving their slots")
        return StoreUnavailable(f"redis cluster node {node} cannot serve these keys: "
                                f"{text}{hint}")
    return None


def pack_set(key: bytes, value: bytes | memoryview, ttl_ms: int | None) -> list[Any]:
    """``SET key value [PX ttl]`` as buffers for ``writelines`` (the value is not copied)."""
    size = memoryview(value).nbytes
    if ttl_ms is None:
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size)
        return [head, value, b"\r\n"]
    ttl = b"%d" % ttl_ms
    head = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size)
    return [head, value, b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)]


def pack_set_if_absent(key: bytes, value: bytes, ttl_ms: int) -> list[Any]:
    """``SET key value NX PX ttl``: the reply is ``OK`` when set, nil when the key exists."""
    ttl = b"%d" % ttl_ms
    return [b"*6\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n"
            b"$%d\r\n%s\r\n" % (len(key), key, len(value), value, len(ttl), ttl)]


def pack_delete(keys: Sequence[bytes]) -> bytes:
    return pack_command(b"DEL", *keys)


PING = pack_command(b"PING")


def is_error(reply: Any) -> bool:
    return isinstance(reply, hiredis.ReplyError)


def explain_rejection(reply: Any, where: str, size: int) -> str:
    """What a refused SET means, and which server setting to change."""
    text = str(reply)
    if text.startswith("NOPERM"):
        return no_permission(text, where)
    if text.startswith("OOM"):
        return (f"redis {where} is full and refuses writes ({text}): its maxmemory is reached "
                "with a noeviction policy; set maxmemory-policy allkeys-lru (a cache should "
                "evict) or raise maxmemory")
    if "bulk" in text.lower() or "too large" in text.lower():
        return (f"redis {where} refused a {size}-byte value ({text}): raise its "
                "proto-max-bulk-len, or pass item_size= to connect() so asynccache chunks "
                "values below the server's limit")
    return f"redis {where} refused a {size}-byte value: {text}"


#: how hiredis and our bulk reader name the first byte of a reply they cannot parse
_BAD_START = re.compile(r"""got "(.)" as reply type byte|got b['"](.)""")


def memcached_hint(exc: BaseException, address: str | None) -> str:
    """``"this looks like a memcached server ... use memcached://..."`` when ``exc`` (a
    parse error) is about a reply starting with a capital letter, else ``""``. A
    memcached server answers every line of a RESP command with a text line (``ERROR``,
    ``CLIENT_ERROR ...``); RESP replies start with a symbol."""
    found = _BAD_START.search(str(exc))
    first = (found.group(1) or found.group(2)) if found else ""
    if not "A" <= first <= "Z":
        return ""
    url = f"memcached://{address}" if address else "memcached://host:port"
    return (f"this looks like a memcached server, not Redis (its reply is a text line "
            f"starting with {first!r}, as memcached's ERROR): use {url}, or point the URL "
            "at a Redis port")


def unexpected_reply(where: str, exc: BaseException, address: str | None) -> StoreError:
    """What a reply that is not RESP means: from a memcached server, the wrong URL, not
    damage -- a ``StoreUnavailable`` (the node is backed off, like any node that cannot
    serve) saying which URL to use (`memcached_hint()`). Anything else: a StoreError
    (the connection is closed, its stream not trusted)."""
    hint = memcached_hint(exc, address)
    if hint:
        return StoreUnavailable(f"redis {where}: {hint}")
    return StoreError(f"redis {where} sent an unexpected reply: {exc}")
