"""memcached's multi-line admin commands (``stats settings``, ``lru_crawler metadump``)
on a short-lived connection of their own.

Why not the pipelined data connections: these replies are many ``STAT``/``key=`` lines up
to ``END``, which the data-path parser (`asynccache.store.protocol.memcache`) has no
reason to know, and memcached refuses to pipeline anything before a metadump. They are
rare (the command line), so one plain ``asyncio`` stream per command is enough.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import unquote_to_bytes

from ...errors import StoreError, StoreTimeout, StoreUnavailable, Unsupported
from ..transport.endpoint import Endpoint

__all__ = ["AdminRefused", "admin_lines", "metadump_keys", "settings"]

#: Least seconds an admin command may wait for each line (a metadump of a large server
#: streams for a while; the data path's timeout is meant for single round trips).
MIN_LINE_TIMEOUT = 5.0
#: How often a metadump that finds the crawler busy (another dump running) is retried.
BUSY_RETRIES = 50


async def admin_lines(target: Endpoint, command: bytes) -> AsyncIterator[bytes]:
    """The lines memcached answers ``command`` with, up to (not including) ``END``; an
    error line raises StoreError (``BUSY ...`` included: the caller may retry)."""
    where, tls, what = target.where, target.tls, command.decode()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            target.host, target.port, ssl=None if tls is None else tls.context(),
            server_hostname=None if tls is None else target.host), target.connect_timeout)
    except (asyncio.TimeoutError, OSError) as exc:
        raise target.connect_failure(exc) from exc
    line_timeout = max(target.timeout, MIN_LINE_TIMEOUT)
    try:
        writer.write(command + b"\r\n")
        while True:
            try:
                line = await asyncio.wait_for(reader.readline(), line_timeout)
            except asyncio.TimeoutError as exc:
                raise StoreTimeout(f"memcached {where} stopped answering {what!r} for "
                                   f"{line_timeout:g}s") from exc
            except (OSError, ValueError) as exc:  # ValueError: a line over the stream limit
                raise StoreError(f"memcached {where} failed during {what!r}: {exc}") from exc
            if not line.endswith(b"\n"):  # metadump ends its lines with \n alone
                raise StoreUnavailable(f"memcached {where} closed the connection during "
                                       f"{what!r}")
            line = line.rstrip(b"\r\n")
            if line == b"END":
                return
            if line.split(b" ")[0] in _REFUSALS:
                raise AdminRefused(where, what, line.decode(errors="replace"))
            yield line
    finally:
        writer.close()


class AdminRefused(StoreError):
    """memcached answered an admin command with an error (or ``BUSY``) line."""

    def __init__(self, where: str, command: str, line: str) -> None:
        super().__init__(f"memcached {where} answered {command!r} with {line}")
        self.line = line


_REFUSALS = {b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR", b"BUSY"}


async def settings(target: Endpoint) -> dict[str, str]:
    """``stats settings`` as ``{name: value}`` (``item_size_max`` is the ``-I``)."""
    found: dict[str, str] = {}
    async for line in admin_lines(target, b"stats settings"):
        _stat, _, rest = line.decode(errors="replace").partition(" ")
        name, _, value = rest.partition(" ")
        found[name] = value
    return found


async def metadump_keys(target: Endpoint) -> AsyncIterator[bytes]:
    """Every key the server holds (``lru_crawler metadump all``), decoded from the
    percent-encoding memcached lists them in. Retried while the crawler is busy."""
    for _attempt in range(BUSY_RETRIES):
        started = False
        try:
            async for line in admin_lines(target, b"lru_crawler metadump all"):
                started = True
                field = line.partition(b" ")[0]
                if field.startswith(b"key="):
                    yield unquote_to_bytes(field[4:])
            return
        except AdminRefused as exc:
            if started:
                raise
            if exc.line.startswith("BUSY"):
                await asyncio.sleep(0.1)
                continue
            raise Unsupported(f"{exc}: this memcached cannot list its keys; it needs 1.4.31 "
                              "or later with the LRU crawler on (the default) and dumps "
                              "allowed (no -o no_lru_crawler, no dump_disabled)") from exc
    raise StoreError(f"memcached {target.where}: the LRU crawler stayed busy (another "
                     "metadump running?); try again")
