"""Redis / Valkey over TCP, TLS or a unix socket, with ``redis.asyncio`` and hiredis.

Reads are ``MGET`` chunks of ``max_batch`` keys; the chunks of one request run
concurrently over a bounded (blocking) connection pool, so a 10 000-key request costs
about ``ceil(10000 / max_batch / max_connections)`` round trips. Writes are pipelined
``SET`` commands (with ``PX`` when a TTL is given), also chunked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ..errors import StoreError, StoreTimeout, StoreUnavailable
from .base import BaseClient, chunked
from .blocking_resp import BlockingRespReader
from .resp import RespConnection

__all__ = ["RedisClient", "run_translated", "translate_redis_error"]


def translate_redis_error(exc: BaseException, where: str) -> StoreError:
    """Map redis-py's exceptions (which shadow builtins) onto ours."""
    if isinstance(exc, rexc.TimeoutError | asyncio.TimeoutError):
        return StoreTimeout(f"redis timed out during {where}: {exc}")
    if isinstance(exc, rexc.AuthenticationError | rexc.AuthenticationWrongNumberOfArgsError):
        return StoreUnavailable(
            f"redis refused the credentials during {where}: {exc}; check user/password in the URL"
        )
    if isinstance(exc, rexc.ConnectionError | OSError | EOFError | RuntimeError):
        return StoreUnavailable(f"redis connection failed during {where}: {exc}")
    return StoreError(f"redis error during {where}: {type(exc).__name__}: {exc}")


async def run_translated(client: BaseClient[Any], coro: Any, where: str) -> Any:
    """Await a redis-py call with the client's timeout, translating its exceptions."""
    try:
        return await client._bounded(coro, where)
    except StoreError:
        raise
    except (rexc.RedisError, OSError, EOFError, RuntimeError) as exc:
        # RuntimeError: uvloop's "handler is closed" when writing to a reset socket
        raise translate_redis_error(exc, where) from exc


@dataclass
class _RedisState:
    redis: aioredis.Redis
    reads: RespConnection | None  # the lean MGET path; None over TLS (redis-py does it)


class RedisClient(BaseClient[_RedisState]):
    """Client for one Redis-protocol server (Redis, Valkey, KeyDB, Dragonfly...)."""

    scheme = "redis"
    max_value_size = 512 * 1024 * 1024

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        unix_socket_path: str | None = None,
        ssl: bool = False,
        ssl_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.host = host
        self.port = port
        self.db = db
        self.username = username
        self.password = password
        self.unix_socket_path = unix_socket_path
        self.ssl = ssl
        self.ssl_options = dict(ssl_options or {})

    @property
    def safe_url(self) -> str:
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}:***@" if self.password else f"{self.username}@"
        if self.unix_socket_path:
            return f"unix://{auth}{self.unix_socket_path}?db={self.db}"
        scheme = "rediss" if self.ssl else "redis"
        return f"{scheme}://{auth}{self.host}:{self.port}/{self.db}"

    def _connection_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "db": self.db,
            "username": self.username,
            "password": self.password,
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.connect_timeout,
            # one immediate retry on a broken connection (a pooled socket that went stale
            # when the server restarted); never on timeouts, which would double the wait
            "retry": Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
        }
        if self.unix_socket_path:
            kwargs["connection_class"] = aioredis.UnixDomainSocketConnection
            kwargs["path"] = self.unix_socket_path
        else:
            kwargs["host"] = self.host
            kwargs["port"] = self.port
            if self.ssl:
                kwargs["connection_class"] = aioredis.SSLConnection
                kwargs.update(self.ssl_options)
        return kwargs

    def _open_state(self) -> _RedisState:
        pool = aioredis.BlockingConnectionPool(
            max_connections=self.max_connections,
            timeout=self.timeout,
            **self._connection_kwargs(),
        )
        reads = None
        if not self.ssl:
            reads = RespConnection(
                host=self.host, port=self.port, unix_socket_path=self.unix_socket_path,
                username=self.username, password=self.password, db=self.db,
                timeout=self.timeout, connect_timeout=self.connect_timeout, where=self.safe_url)
        return _RedisState(aioredis.Redis(connection_pool=pool), reads)

    def blocking_reader(self) -> BlockingRespReader | None:
        """Consumer-driven MGETs for plain Redis (TLS reads go through redis-py)."""
        if self.ssl:
            return None
        return BlockingRespReader(
            host=self.host, port=self.port, unix_socket_path=self.unix_socket_path,
            username=self.username, password=self.password, db=self.db,
            timeout=self.timeout, connect_timeout=self.connect_timeout, where=self.safe_url)

    async def _close_state(self, state: _RedisState) -> None:
        if state.reads is not None:
            state.reads.close()
        await state.redis.aclose()
        await state.redis.connection_pool.disconnect()

    async def _run(self, coro: Any, where: str) -> Any:
        return await run_translated(self, coro, where)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        state = self._state()
        if state.reads is not None:
            return await state.reads.mget(chunked(keys, self.max_batch))
        r = state.redis
        if len(keys) <= self.max_batch:
            return await self._run(r.mget(keys), "MGET")
        parts = await asyncio.gather(
            *(self._run(r.mget(chunk), "MGET") for chunk in chunked(keys, self.max_batch))
        )
        return [value for part in parts for value in part]

    async def _set_chunk(self, r: aioredis.Redis, items: Sequence[tuple[bytes, bytes]],
                         ttl_ms: int | None) -> None:
        if ttl_ms is None:
            await r.mset(dict(items))
            return
        pipe = r.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, px=ttl_ms)
        await pipe.execute()

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        if not mapping:
            return
        r = self._state().redis
        ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        items = list(mapping.items())
        await asyncio.gather(
            *(self._run(self._set_chunk(r, chunk, ttl_ms), "SET")
              for chunk in chunked(items, self.max_batch))
        )

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        r = self._state().redis
        await asyncio.gather(
            *(self._run(r.delete(*chunk), "DEL") for chunk in chunked(keys, self.max_batch))
        )

    async def ping(self) -> None:
        await self._run(self._state().redis.ping(), "PING")
