"""Redis Cluster: keys grouped by hash slot, one ``MGET`` per slot, nodes concurrently.

``redis.asyncio.cluster.RedisCluster`` already does the slot bookkeeping (it follows
``MOVED``/``ASK`` redirections and refreshes the slot map); ``mget_nonatomic`` groups a
request by slot and runs the per-node pipelines concurrently, putting results back in
the caller's order. This module adds the client interface, chunking and timeouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, RedisCluster

from ..errors import StoreError, StoreTimeout, StoreUnavailable
from .base import BaseClient, chunked


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

__all__ = ["RedisClusterClient"]


@dataclass
class _ClusterState:
    cluster: RedisCluster


class RedisClusterClient(BaseClient[_ClusterState]):
    """Client for a Redis Cluster given one or more startup nodes."""

    scheme = "redis+cluster"
    max_value_size = 512 * 1024 * 1024

    def __init__(
        self,
        *,
        nodes: Sequence[tuple[str, int]],
        username: str | None = None,
        password: str | None = None,
        ssl: bool = False,
        **options: Any,
    ) -> None:
        options.setdefault("max_batch", 512)
        super().__init__(**options)
        self.nodes = [(str(h), int(p)) for h, p in nodes]
        self.username = username
        self.password = password
        self.ssl = ssl

    @property
    def safe_url(self) -> str:
        auth = f"{self.username or ''}:***@" if self.password else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"redis+cluster://{auth}{hosts}"

    def _open_state(self) -> _ClusterState:
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
            username=self.username,
            password=self.password,
            ssl=self.ssl,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.connect_timeout,
            max_connections=max(self.max_connections, 4),
        )
        return _ClusterState(cluster)

    async def _close_state(self, state: _ClusterState) -> None:
        await state.cluster.aclose()

    async def _run(self, coro: Any, where: str) -> Any:
        return await run_translated(self, coro, where)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        rc = self._state().cluster
        parts = await asyncio.gather(
            *(self._run(rc.mget_nonatomic(list(chunk)), "MGET")
              for chunk in chunked(keys, self.max_batch))
        )
        return [value for part in parts for value in part]

    async def _set_chunk(self, rc: RedisCluster, items: Sequence[tuple[bytes, bytes]],
                         ttl_ms: int | None) -> None:
        pipe = rc.pipeline()
        for key, value in items:
            pipe.set(key, value, px=ttl_ms)
        await pipe.execute()

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        if not mapping:
            return
        rc = self._state().cluster
        ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        await asyncio.gather(
            *(self._run(self._set_chunk(rc, chunk, ttl_ms), "SET")
              for chunk in chunked(list(mapping.items()), self.max_batch))
        )

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        rc = self._state().cluster
        await asyncio.gather(
            *(self._run(rc.delete(*chunk), "DEL") for chunk in chunked(list(keys), self.max_batch))
        )

    async def ping(self) -> None:
        rc = self._state().cluster
        await self._run(rc.ping(target_nodes=RedisCluster.ALL_NODES), "PING")
