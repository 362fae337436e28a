"""Redis / Valkey over TCP, TLS or a unix socket, on the lean pipelined RESP connection.

Every command goes through `RespConnection` (hiredis parsing, one timer per exchange,
pipelined): redis-py's per-command cost (80–170 µs of CPU per call measured here) is most of
a cached read's cost, and the handful of commands a cache needs (``MGET``, ``SET [PX]``,
``DEL``, ``PING``) are simple. Two connections per event loop: reads never queue behind a
large write. The reads connection (`MgetConnection`: ``MGET`` and ``PING`` only) receives
large values in place once the values it reads are large; everything else (the command
line's ``INFO``, ``SCAN``, ``EXISTS``, ``STRLEN`` included) goes on the writes connection.

Writes are one pipelined ``SET`` per key, so the server answers each key: a key it
refuses (out of memory with a noeviction policy, over ``proto-max-bulk-len``) fails
alone, as a ``StoreRejected`` naming the limit, while the others are written.

The consumer-side read path (`RedisClient.consumer_reads()`) uses the same endpoint
settings (TLS included) on a blocking socket of the consumer thread's own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, StoreError, StoreRejected
from ..api import (
    BaseClient,
    ConsumerReads,
    NodeName,
    ReadResult,
    WriteResult,
    chunked,
    read_one_node,
)
from ..credentials import Credential
from ..protocol.resp import (
    PING,
    explain_rejection,
    is_error,
    pack_delete,
    pack_set,
    pack_set_if_absent,
)
from ..transport.tls import TlsSettings
from .admin import node_info, pack_exists, pack_strlen, scan_node, size_of
from .connection import MgetConnection, RespConnection
from .consumer import BlockingRespConnection
from .endpoint import RedisEndpoint

__all__ = ["RedisClient"]


@dataclass
class _RedisState:
    reads: MgetConnection  # MGET and PING only (its parser may be the bulk reader)
    writes: RespConnection  # everything else


class RedisClient(BaseClient[_RedisState]):
    """Client for one Redis-protocol server (Redis, Valkey, KeyDB, Dragonfly...)."""

    scheme = "redis"
    reads_own_buffers = True  # large values are received in place (`MgetConnection`)

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        password_env: str | None = None,
        unix_socket_path: str | None = None,
        ssl: bool = False,
        tls: TlsSettings | None = None,
        item_size: int = 512 * 1024 * 1024,
        **options: Any,
    ) -> None:
        """The server, and how to reach and authenticate to it.

        Args:
            host: the server's host.
            port: its TCP port.
            db: the database number.
            username: the ACL user (``None``: the default user).
            password: the password (kept out of reprs, logs and pickles).
            password_env: an environment variable holding the password (read in each
                process, never exported).
            unix_socket_path: connect over this unix socket instead of TCP.
            ssl: TLS with the defaults (the system's CAs, hostname checked).
            tls: TLS with these settings.
            item_size: the server's ``proto-max-bulk-len``: larger values are chunked.
            **options: `BaseClient`'s: ``timeout``, ``connect_timeout``, ``max_batch``.
        """
        super().__init__(**options)
        self.host = host
        self.port = port
        self.db = db
        self.username = username
        self.unix_socket_path = unix_socket_path
        self.tls = tls if tls is not None or not ssl else TlsSettings()
        if self.tls is not None and unix_socket_path:
            raise ConfigError("TLS over a unix socket is not supported: Redis serves TLS "
                              "on TCP ports only")
        #: the server's proto-max-bulk-len (512 MiB by default): larger values are chunked
        self.max_value_size = int(item_size)
        self._credential = Credential.keep(self.safe_url, password, password_env)

    @property
    def ssl(self) -> bool:
        return self.tls is not None

    @property
    def safe_url(self) -> str:
        auth = ""
        if self.username or self._credential:
            auth = f"{self.username or ''}:***@" if self._credential else f"{self.username}@"
        if self.unix_socket_path:
            return f"unix://{auth}{self.unix_socket_path}?db={self.db}"
        scheme = "rediss" if self.ssl else "redis"
        return f"{scheme}://{auth}{self.host}:{self.port}/{self.db}"

    def endpoint(self) -> RedisEndpoint:
        return RedisEndpoint(
            host=None if self.unix_socket_path else self.host,
            port=None if self.unix_socket_path else self.port,
            unix_socket_path=self.unix_socket_path, username=self.username,
            password=self.password, db=self.db, timeout=self.timeout,
            connect_timeout=self.connect_timeout, where=self.safe_url, tls=self.tls)

    def _open_state(self) -> _RedisState:
        endpoint = self.endpoint()
        return _RedisState(MgetConnection(endpoint), RespConnection(endpoint))

    async def _close_state(self, state: _RedisState) -> None:
        state.reads.close()
        state.writes.close()

    def consumer_reads(self) -> ConsumerReads:
        """Read-ahead on the consumer's own socket (TCP, TLS or unix socket)."""
        return ConsumerReads([BlockingRespConnection(self.endpoint(), self.node_names[0])])

    # -- operations ---------------------------------------------------------------------
    async def read(self, keys: Sequence[bytes], skip: Collection[NodeName] = ()) -> ReadResult:
        """One pipelined ``MGET`` per ``max_batch`` keys; all or nothing (one node)."""
        return await read_one_node(self, self._mget, keys, skip)

    async def _mget(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        return await self._state().reads.mget(chunked(keys, self.max_batch))

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        node = self.node_names[0]
        if node in skip:
            return WriteResult(skipped=len(entries))
        if not entries:
            return WriteResult(answered=[node])
        ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        items = list(entries.items())
        try:
            replies = await self._state().writes.execute(
                [pack_set(k, v, ttl_ms) for k, v in items])
        except StoreError as exc:
            return WriteResult(failures={node: exc}, failed_keys=len(items))
        result = WriteResult(answered=[node])
        for (key, value), reply in zip(items, replies):
            if is_error(reply):
                size = memoryview(value).nbytes
                result.rejected[key] = StoreRejected(explain_rejection(reply, node, size))
            else:
                result.written += 1
        return result

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        replies = await self._state().writes.execute(
            [[pack_delete(chunk)] for chunk in chunked(keys, self.max_batch)])
        for reply in replies:
            if is_error(reply):
                raise StoreError(f"redis {self.safe_url} refused DEL: {reply}")

    async def ping(self) -> None:
        (reply,) = await self._state().reads.execute([[PING]])
        if is_error(reply):
            raise StoreError(f"redis {self.safe_url} answered PING with {reply}")

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        if not entries:
            return []
        ttl_ms = max(1, int(ttl * 1000))
        replies = await self._state().writes.execute(
            [pack_set_if_absent(k, v, ttl_ms) for k, v in entries.items()])
        for reply in replies:
            if is_error(reply):
                raise StoreError(f"redis {self.safe_url} refused SET NX: {reply}")
        return [reply is not None for reply in replies]

    # -- administration -------------------------------------------------------------------
    async def server_info(self) -> dict[str, Any]:
        node = self.node_names[0]
        info = await node_info(self._state().writes, node)
        return {"max_value_size": self.max_value_size, "nodes": {node: info}}

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        """``SCAN MATCH`` over this database, with ``STRLEN`` sizes (pipelined)."""
        async for page in scan_node(self._state().writes, prefix, batch, self.safe_url):
            yield page

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipelined ``EXISTS`` per key: no value crosses the network."""
        if not keys:
            return []
        replies = await self._state().writes.execute([[pack_exists(k)] for k in keys])
        for reply in replies:
            if is_error(reply):
                raise StoreError(f"redis {self.safe_url} answered EXISTS with {reply}")
        return [reply == 1 for reply in replies]

    async def sizes_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """One pipelined ``STRLEN`` per key: sizes, no value crosses the network."""
        if not keys:
            return []
        replies = await self._state().writes.execute([[pack_strlen(k)] for k in keys])
        return [size_of(reply, self.safe_url) for reply in replies]
