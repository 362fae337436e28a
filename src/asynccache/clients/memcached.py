"""memcached, one server or a pool of them, with ``aiomcache``.

What aiomcache leaves to us, and how it is handled here:

* **Many servers** — keys are spread by rendezvous (highest-random-weight) hashing, so
  adding or removing a server moves only the keys that belonged to it; each request is
  grouped per server and the servers are queried concurrently.
* **Keys** — memcached takes 1–250 bytes of printable ASCII without spaces. Other keys
  (too long, whitespace, control characters, non-ASCII) are replaced, deterministically,
  by ``b"ac#" + blake2b(key).hexdigest()``.
* **Duplicates** — ``multi_get`` rejects duplicate keys: requests are de-duplicated first.
* **Line length** — ``multi_get`` sends one unsplit line: requests are cut at
  ``max_batch`` keys.
* **Timeouts** — aiomcache has none; every call is bounded here. A cancelled call leaves
  its connection mid-reply (aiomcache only discards connections on ``Exception``, not on
  cancellation), so after a timeout the node's connection pool is replaced and the old
  one closed: a late reply can never be read as the answer to the next request.
* **Item size** — values above ``item_size`` (``-I``, 1 MiB by default) are refused by
  the server; ``max_value_size`` tells the core to split them into chunks.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiomcache
import aiomcache.exceptions

from ..errors import StoreError, StoreTimeout, StoreUnavailable, ValueTooLarge
from .base import BaseClient, chunked

__all__ = ["MemcachedClient", "rendezvous_owner", "safe_memcached_key"]

_SAFE_KEY = re.compile(rb"^[\x21-\x7e]{1,250}$")
_THIRTY_DAYS = 30 * 24 * 3600
#: Room for memcached's per-item header within the slab item size.
_ITEM_OVERHEAD = 1024


def safe_memcached_key(key: bytes) -> bytes:
    """``key`` itself when memcached accepts it, else a fixed-length digest of it."""
    if _SAFE_KEY.match(key) and not key.startswith(b"ac#"):
        return key
    return b"ac#" + hashlib.blake2b(key, digest_size=20).hexdigest().encode()


def rendezvous_owner(key: bytes, nodes: Sequence[str]) -> int:
    """Index of the node with the highest hash weight for ``key``."""
    best, best_weight = 0, -1
    for index, node in enumerate(nodes):
        digest = hashlib.blake2b(key, digest_size=8, key=node.encode()[:64]).digest()
        weight = int.from_bytes(digest, "big")
        if weight > best_weight:
            best, best_weight = index, weight
    return best


@dataclass
class _Node:
    host: str
    port: int
    pool_size: int
    client: aiomcache.Client = field(init=False)
    retired: list[aiomcache.Client] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = aiomcache.Client(self.host, self.port, pool_size=self.pool_size)

    async def replace_pool(self) -> None:
        """Swap in fresh connections; close the old ones that may hold a late reply."""
        old, self.client = self.client, aiomcache.Client(self.host, self.port,
                                                         pool_size=self.pool_size)
        await old.close()  # idle connections, including the one the cancelled call released
        self.retired.append(old)  # connections still in use elsewhere close on close()

    async def close(self) -> None:
        for client in [*self.retired, self.client]:
            await client.close()
        self.retired.clear()


@dataclass
class _MemcachedState:
    nodes: list[_Node]


class MemcachedClient(BaseClient[_MemcachedState]):
    """Client for one or more memcached servers (rendezvous hashing across them)."""

    scheme = "memcached"

    def __init__(
        self,
        *,
        servers: Sequence[tuple[str, int]] = (("127.0.0.1", 11211),),
        item_size: int = 1024 * 1024,
        **options: object,
    ) -> None:
        options.setdefault("max_batch", 128)
        super().__init__(**options)  # type: ignore[arg-type]
        if not servers:
            raise ValueError("MemcachedClient needs at least one server")
        self.servers = [(str(h), int(p)) for h, p in servers]
        self.item_size = int(item_size)
        self.max_value_size = self.item_size - _ITEM_OVERHEAD
        self._node_names = [f"{h}:{p}" for h, p in self.servers]

    @property
    def safe_url(self) -> str:
        return "memcached://" + ",".join(self._node_names)

    def _open_state(self) -> _MemcachedState:
        return _MemcachedState([_Node(h, p, self.max_connections) for h, p in self.servers])

    async def _close_state(self, state: _MemcachedState) -> None:
        for node in state.nodes:
            await node.close()

    def _owner(self, key: bytes) -> int:
        if len(self.servers) == 1:
            return 0
        return rendezvous_owner(key, self._node_names)

    async def _call(self, node: _Node, coro_fn, *args, what: str):  # type: ignore[no-untyped-def]
        """Run one aiomcache call on ``node``, bounded, with errors translated."""
        try:
            return await asyncio.wait_for(coro_fn(node.client, *args), self.timeout)
        except asyncio.TimeoutError as exc:
            await node.replace_pool()
            raise StoreTimeout(
                f"memcached {node.host}:{node.port} did not answer {what} within "
                f"{self.timeout:g}s; raise `timeout=` in connect() if it is just slow"
            ) from exc
        except asyncio.CancelledError:
            await asyncio.shield(node.replace_pool())
            raise
        except aiomcache.exceptions.ClientException as exc:
            if b"too large" in str(exc).encode() or "too large" in str(exc):
                raise ValueTooLarge(
                    f"memcached {node.host}:{node.port} refused a value as too large "
                    f"({exc}); start memcached with a larger -I or lower the item size"
                ) from exc
            await node.replace_pool()
            raise StoreError(f"memcached {node.host}:{node.port} {what} failed: {exc}") from exc
        except (OSError, EOFError, asyncio.IncompleteReadError, RuntimeError) as exc:
            # RuntimeError: uvloop's "handler is closed" when writing to a reset socket
            await node.replace_pool()
            raise StoreUnavailable(
                f"memcached {node.host}:{node.port} connection failed during {what}: {exc!r}"
            ) from exc

    def _group(self, keys: Sequence[bytes]) -> dict[int, list[bytes]]:
        groups: dict[int, list[bytes]] = {}
        for key in keys:
            groups.setdefault(self._owner(key), []).append(key)
        return groups

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        nodes = self._state().nodes
        safe = [safe_memcached_key(k) for k in keys]
        unique = list(dict.fromkeys(safe))
        calls = []
        batches: list[Sequence[bytes]] = []
        for index, group in self._group(unique).items():
            for batch in chunked(group, self.max_batch):
                batches.append(batch)
                calls.append(self._call(nodes[index], _multi_get, batch, what="get"))
        results = await asyncio.gather(*calls)
        found: dict[bytes, bytes | None] = {}
        for batch, values in zip(batches, results):
            found.update(zip(batch, values))
        return [found.get(k) for k in safe]

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        if not mapping:
            return
        nodes = self._state().nodes
        exptime = _exptime(ttl)
        calls = []
        for key, value in mapping.items():
            safe = safe_memcached_key(key)
            calls.append(self._call(nodes[self._owner(safe)], _set, safe, bytes(value), exptime,
                                    what="set"))
        await _gather_all(calls)

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        nodes = self._state().nodes
        unique = list(dict.fromkeys(safe_memcached_key(k) for k in keys))
        await _gather_all(
            [self._call(nodes[self._owner(k)], _delete, k, what="delete") for k in unique]
        )

    async def ping(self) -> None:
        nodes = self._state().nodes
        await _gather_all([self._call(node, _version, what="version") for node in nodes])


async def _gather_all(calls: list) -> None:  # type: ignore[type-arg]
    """Await every call even when one fails, then raise the first failure."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _exptime(ttl: float | None) -> int:
    """memcached's exptime: seconds, or an absolute unix time beyond 30 days."""
    if ttl is None:
        return 0
    seconds = max(1, math.ceil(ttl))
    return seconds if seconds <= _THIRTY_DAYS else int(time.time()) + seconds


async def _multi_get(client: aiomcache.Client, keys: Sequence[bytes]) -> tuple[bytes | None, ...]:
    return await client.multi_get(*keys)


async def _set(client: aiomcache.Client, key: bytes, value: bytes, exptime: int) -> None:
    await client.set(key, value, exptime=exptime)


async def _delete(client: aiomcache.Client, key: bytes) -> None:
    await client.delete(key)


async def _version(client: aiomcache.Client) -> None:
    await client.version()
