"""A real store outside the package: one SQLite file, shared by processes (WAL mode).

Written against the public API only (``asynccache.Provider``, the ``Store*`` errors), as
the README tells a third party to; the tests register it with ``register_scheme`` and,
in a subprocess, through an ``asynccache.stores`` entry point.

``sqlite:///path/to/file.db`` (``?busy_ms=`` how long to wait for another writer). The
``fault`` option makes the operations misbehave, for the tests of the failure rules:
``store_error`` (raise StoreUnavailable), ``foreign`` (raise a ZeroDivisionError),
``hang`` (never answer).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import asynccache as ac

SCHEMA = "CREATE TABLE IF NOT EXISTS kv (key BLOB PRIMARY KEY, value BLOB, expires REAL)"


class SqliteStore(ac.Provider):
    """Keys, values and an expiry time (Unix seconds, NULL: never) in one table."""

    scheme = "sqlite"

    def __init__(self, url: str, *, busy_ms: int | str = 5000, fault: str = "",
                 **options: Any) -> None:
        super().__init__(url, **options)
        self.path = urlsplit(url).path
        if not self.path:
            raise ac.InvalidURL(f"{url!r} names no file; write sqlite:///path/to/file.db")
        self.busy_ms = int(busy_ms)
        if fault not in ("", "store_error", "foreign", "hang"):
            raise ac.ConfigError(f"fault={fault!r}: expected store_error, foreign or hang")
        self.fault = fault

    def open_connection(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.busy_ms / 1000, isolation_level=None,
                               check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(SCHEMA)
        return conn

    def close_connection(self, conn: sqlite3.Connection) -> None:
        conn.close()

    async def _misbehave(self) -> None:
        if self.fault == "store_error":
            raise ac.StoreUnavailable(f"{self.safe_url}: the test asked for a failure")
        if self.fault == "foreign":
            raise ZeroDivisionError("a bug in the provider")
        if self.fault == "hang":
            await asyncio.sleep(3600)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        await self._misbehave()
        now = time.time()
        found: dict[bytes, bytes] = {}
        wanted = list(dict.fromkeys(keys))
        for start in range(0, len(wanted), 500):  # SQLite's limit on bound parameters
            part = wanted[start:start + 500]
            rows = self.connection.execute(
                f"SELECT key, value FROM kv WHERE key IN ({','.join('?' * len(part))}) "
                "AND (expires IS NULL OR expires > ?)", [*part, now])
            found.update((bytes(k), bytes(v)) for k, v in rows)
        return [found.get(key) for key in keys]

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        await self._misbehave()
        expires = None if ttl is None else time.time() + ttl
        conn = self.connection
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?, ?)",
                             [(k, bytes(v), expires) for k, v in mapping.items()])
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        await self._misbehave()
        self.connection.executemany("DELETE FROM kv WHERE key = ?", [(k,) for k in keys])

    async def ping(self) -> None:
        await self._misbehave()
        self.connection.execute("SELECT 1").fetchone()

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        await self._misbehave()
        now = time.time()
        conn = self.connection
        added = []
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("DELETE FROM kv WHERE expires IS NOT NULL AND expires <= ?", (now,))
            for key, value in entries.items():
                cursor = conn.execute("INSERT OR IGNORE INTO kv VALUES (?, ?, ?)",
                                      (key, bytes(value), now + ttl))
                added.append(cursor.rowcount == 1)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return added
