"""Admin commands for one Redis-protocol node (``INFO``, ``SCAN``, ``STRLEN``, ``EXISTS``),
shared by the single-server and the cluster client.

On the same pipelined `RespConnection` as the data: one connection per node already exists,
and these are few (the command line).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from ...errors import StoreError
from ..protocol.resp import is_error, pack_command
from .connection import RespConnection

__all__ = ["glob_escape", "node_info", "pack_exists", "pack_strlen", "scan_node", "size_of"]

_GLOB_SPECIAL = frozenset(b"*?[]\\")


def glob_escape(prefix: bytes) -> bytes:
    """``prefix`` with the characters ``SCAN MATCH`` treats as a pattern escaped."""
    return bytes(b for c in prefix for b in ((92, c) if c in _GLOB_SPECIAL else (c,)))


def pack_exists(key: bytes) -> bytes:
    return pack_command(b"EXISTS", key)


def pack_strlen(key: bytes) -> bytes:
    """``STRLEN key``: the value's size, 0 for a missing key; no value is sent."""
    return pack_command(b"STRLEN", key)


def size_of(reply: Any, where: str) -> int | None:
    """A ``STRLEN`` reply as `BaseClient.sizes_many()` says
    it: the size, or None for no value (missing, or a key of another type: a write
    replaces it); an error reply is a StoreError."""
    if type(reply) is int:
        return reply or None
    if is_error(reply) and str(reply).startswith("WRONGTYPE"):
        return None
    raise StoreError(f"redis {where} answered STRLEN with {reply!r:.200}")


def _fields(reply: Any) -> dict[str, str]:
    text = bytes(reply).decode(errors="replace") if not isinstance(reply, str) else reply
    found = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and not name.startswith("#"):
            found[name.strip()] = value.strip()
    return found


async def node_info(conn: RespConnection, where: str) -> dict[str, Any]:
    """``server`` (redis or valkey), ``version``, ``item_size`` (``proto-max-bulk-len``;
    None when ``CONFIG GET`` is not allowed, as under many ACLs and managed services)
    and ``used_memory`` (bytes) of one node."""
    info, config = await conn.execute([[pack_command(b"INFO")],
                                       [pack_command(b"CONFIG", b"GET", b"proto-max-bulk-len")]])
    if is_error(info):
        raise StoreError(f"redis {where} answered INFO with {info}")
    fields = _fields(info)
    server = "valkey" if "valkey_version" in fields or fields.get("server_name") == "valkey" \
        else "redis"
    item_size = None
    if isinstance(config, list) and len(config) == 2 and bytes(config[1]).isdigit():
        item_size = int(config[1])
    used = fields.get("used_memory", "")
    return {"server": server,
            "version": fields.get("valkey_version") or fields.get("redis_version", ""),
            "item_size": item_size, "used_memory": int(used) if used.isdigit() else None}


async def scan_node(conn: RespConnection, prefix: bytes, batch: int, where: str
                    ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
    """``SCAN ... MATCH <prefix>* COUNT batch`` over the whole keyspace of one node, each
    non-empty page with its values' sizes (``STRLEN``, pipelined; None for a key that
    is not a string)."""
    pattern = glob_escape(prefix) + b"*"
    count = b"%d" % max(1, batch)
    cursor = b"0"
    while True:
        (reply,) = await conn.execute([[pack_command(b"SCAN", cursor, b"MATCH", pattern,
                                                     b"COUNT", count)]])
        if is_error(reply) or not isinstance(reply, list) or len(reply) != 2:
            raise StoreError(f"redis {where} answered SCAN with {reply!r:.200}")
        cursor, keys = bytes(reply[0]), [bytes(k) for k in reply[1]]
        if keys:
            yield list(zip(keys, await _sizes(conn, keys)))
        if cursor == b"0":
            return


async def _sizes(conn: RespConnection, keys: Sequence[bytes]) -> list[int | None]:
    replies = await conn.execute([[pack_command(b"STRLEN", key)] for key in keys])
    return [reply if type(reply) is int else None for reply in replies]
