"""Redis Cluster on the lean RESP path: redis-py keeps the slot map, every byte of data
goes over one pipelined `RespConnection` per primary.

Why it is built this way: docs/design.md, "Redis Cluster".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from redis.asyncio.cluster import ClusterNode as StartupNode
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from ...errors import CacheError, StoreError
from ..api import (
    NOT_READ,
    BaseClient,
    ConsumerReads,
    NodeName,
    ReadResult,
    WriteResult,
    chunked,
)
from ..credentials import Credential
from ..loop import get_loop_thread
from ..protocol.resp import PING, is_error, pack_delete, pack_set, pack_set_if_absent
from ..transport.tls import TlsSettings
from .admin import node_info, pack_exists, pack_strlen, scan_node, size_of
from .cluster_calls import Delete, PerKey, Read, Write, added, exists
from .cluster_consumer import ConsumerRoutes
from .cluster_map import (
    REDIRECT_REFRESH_INTERVAL,
    REFRESH_INTERVAL,
    ClusterMap,
    KnownPrimaries,
    NodeAccess,
)
from .cluster_slots import Command, SlotView, Target, key_slots

__all__ = ["RedisClusterClient"]

logger = logging.getLogger("asynccache")
T = TypeVar("T")

class RedisClusterClient(BaseClient[ClusterMap]):
    """Client for a Redis Cluster given one or more startup nodes."""

    scheme = "redis+cluster"
    max_value_size = 512 * 1024 * 1024

    def __init__(
        self,
        *,
        nodes: Sequence[tuple[str, int]],
        username: str | None = None,
        password: str | None = None,
        password_env: str | None = None,
        ssl: bool = False,
        tls: TlsSettings | None = None,
        **options: Any,
    ) -> None:
        """Credentials and TLS as for `RedisClient`; the slot map (redis-py) and the data
        connections use the same settings.

        Args:
            nodes: ``(host, port)`` of one or more startup nodes.
            username: the ACL user (``None``: the default user).
            password: the password (kept out of reprs, logs and pickles).
            password_env: an environment variable holding the password.
            ssl: TLS with the defaults (the system's CAs, hostname checked).
            tls: TLS with these settings, to every node.
            **options: `BaseClient`'s: ``timeout``, ``connect_timeout``, ``max_batch``
                (default 512).
        """
        options.setdefault("max_batch", 512)
        super().__init__(**options)
        self.nodes = [(str(h), int(p)) for h, p in nodes]
        self.username = username
        self.tls = tls if tls is not None or not ssl else TlsSettings()
        self._credential = Credential.keep(self.safe_url, password, password_env)

    @property
    def ssl(self) -> bool:
        return self.tls is not None

    def _init_runtime(self) -> None:
        super()._init_runtime()
        #: the primaries of the latest slot map this process read (see node_names)
        self._primaries = KnownPrimaries()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_primaries", None)
        return state

    @property
    def safe_url(self) -> str:
        auth = f"{self.username or ''}:***@" if self._credential else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://{auth}{hosts}"

    @property
    def node_names(self) -> tuple[NodeName, ...]:
        """The primaries (``host:port``) of the latest slot map read in this process; the
        startup nodes until one was read. A failure before any map was read (no startup
        node answers) is reported under `safe_url`."""
        return self._primaries.names or tuple(NodeName(f"{h}:{p}") for h, p in self.nodes)

    # -- per-loop state: the slot map and one node per primary -------------------------
    def _access(self) -> NodeAccess:
        return NodeAccess(self.safe_url, self.username, self.password, self.tls,
                          self.timeout, self.connect_timeout, self.max_batch)

    def _open_state(self) -> ClusterMap:
        topology = RedisCluster(
            startup_nodes=[StartupNode(h, p) for h, p in self.nodes],
            # a slot nobody serves costs its own keys, not the whole map
            require_full_coverage=False,
            username=self.username,
            password=self.password,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.connect_timeout,
            **(self.tls.redis_py_options() if self.tls else {}),
        )
        return ClusterMap(topology, self._access(), self._primaries)

    async def _close_state(self, state: ClusterMap) -> None:
        await state.close()

    def _consumer_trouble(self, redirected: bool) -> None:
        """(Loop thread.) A consumer-side connection saw a redirection, or a node that
        cannot serve: re-read the map soon (the consumers' routing follows it). Nothing
        for a loop without a map (a cache closed meanwhile: no state is opened for it)."""
        try:
            state = self._states.get(asyncio.get_running_loop())
        except RuntimeError:  # the loop is shutting down
            return
        if state is not None:
            state.refresh_soon(REDIRECT_REFRESH_INTERVAL if redirected else REFRESH_INTERVAL)

    def _view(self, loop: asyncio.AbstractEventLoop) -> SlotView | None:
        """(Any thread.) The slot map ``loop``'s state holds now, if it has one."""
        state = self._states.get(loop)
        return None if state is None else state.view

    async def _loaded_state(self) -> ClusterMap:
        """(Loop thread.) This loop's state, its map read if any startup node answers."""
        state = self._state()
        if not state.ready:
            try:
                await state.load()
            except StoreError as exc:
                logger.debug("asynccache: slot map not read yet: %s", exc)
        return state

    def consumer_reads(self) -> ConsumerReads | None:
        """Read-ahead on the consumer thread's own sockets: one blocking connection per
        primary (TLS as configured), routed by the slot map of the process's loop
        thread, which keeps it fresh (see `_ConsumerRoutes`)."""
        loop = get_loop_thread()
        if loop.in_loop_thread():
            return None
        try:
            loop.call(self._loaded_state(), self.connect_timeout + self.timeout + 1)
        except (concurrent.futures.TimeoutError, CacheError):
            pass  # no map yet: the routes send every key to UnservedKeys until one is read
        routes = ConsumerRoutes(self._access(), loop, len(self.node_names),
                                lambda: self._view(loop.loop), self._consumer_trouble,
                                self.read)
        return ConsumerReads(routes.conns, routes.route,
                             fanout=max(1, len(self.node_names)))

    async def _ready(self) -> ClusterMap:
        state = self._state()
        if not state.ready:
            await state.load()
        return state

    @staticmethod
    def _by_slot(keys: Sequence[bytes]) -> dict[int, list[int]]:
        slots: dict[int, list[int]] = {}
        for position, slot in enumerate(key_slots(keys)):
            found = slots.get(slot)
            if found is None:
                slots[slot] = [position]
            else:
                found.append(position)
        return slots

    def _multi_key(self, keys: Sequence[bytes],
                   pack: Callable[[Sequence[bytes]], bytes]) -> list[Command]:
        """One command per slot and per ``max_batch`` keys (a multi-key command must stay
        within one slot). Most slots of a batch hold one key: that case is kept cheap."""
        commands = []
        limit = self.max_batch
        for slot, positions in self._by_slot(keys).items():
            if len(positions) == 1:
                commands.append(Command(slot, positions, [pack((keys[positions[0]],))]))
                continue
            for chunk in chunked(positions, limit):
                commands.append(Command(slot, chunk, [pack([keys[p] for p in chunk])]))
        return commands

    # -- what the core calls ------------------------------------------------------------
    async def read(self, keys: Sequence[bytes], skip: Collection[NodeName] = ()) -> ReadResult:
        if self.safe_url in skip:
            return ReadResult([NOT_READ] * len(keys), skipped=len(keys))
        try:
            state = await self._ready()
        except StoreError as exc:
            return ReadResult([NOT_READ] * len(keys), failures={NodeName(self.safe_url): exc})
        call = Read(state, skip, len(keys))
        if keys:
            await call.read(keys)
        return ReadResult(call.values, call.failures, call.answered, call.skipped)

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        if self.safe_url in skip:
            return WriteResult(skipped=len(entries))
        try:
            state = await self._ready()
        except StoreError as exc:
            return WriteResult(failures={NodeName(self.safe_url): exc}, failed_keys=len(entries))
        items = list(entries.items())
        call = Write(state, skip, items)
        if items:
            ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
            await call.run([Command(key_slot(key), [i], pack_set(key, value, ttl_ms))
                            for i, (key, value) in enumerate(items)])
        return WriteResult(call.written, call.failures, call.failed_keys, call.rejected,
                           call.answered, call.skipped)

    # -- all or nothing -----------------------------------------------------------------
    async def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        call = Delete(await self._ready(), ())
        await call.run(self._multi_key(keys, pack_delete))
        for error in call.failures.values():
            raise error

    async def ping(self) -> None:
        """``PING`` every primary of the slot map, concurrently."""
        state = await self._ready()
        primaries = state.primaries()
        replies = await asyncio.gather(
            *(state.connection(target).execute([[PING]]) for target in primaries),
            return_exceptions=True)
        for target, reply in zip(primaries, replies):
            if isinstance(reply, BaseException):
                raise reply
            if is_error(reply[0]):
                raise StoreError(f"redis cluster node {target.node} answered PING with "
                                 f"{reply[0]}")

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        ttl_ms = max(1, int(ttl * 1000))
        return await self._per_key([pack_set_if_absent(key, value, ttl_ms)
                                    for key, value in entries.items()], list(entries),
                                   False, added)

    async def _per_key(self, commands: list[list[Any]], keys: Sequence[bytes],
                       unanswered: T, parse: Callable[[Any, str], T]) -> list[T]:
        """``commands[i]`` for ``keys[i]``, pipelined per owning node, nodes
        concurrently: ``parse(reply, where)`` of each key's reply."""
        call = PerKey(await self._ready(), len(keys), unanswered, parse)
        if keys:
            await call.run([Command(key_slot(key), [i], command)
                            for i, (key, command) in enumerate(zip(keys, commands))])
        for error in call.failures.values():
            raise error
        return call.results

    # -- administration -------------------------------------------------------------------
    async def _primaries_now(self) -> tuple[ClusterMap, list[Target]]:
        state = await self._ready()
        return state, state.primaries()

    async def server_info(self) -> dict[str, Any]:
        """Every primary's server, version, item size and memory, concurrently."""
        state, primaries = await self._primaries_now()
        infos = await asyncio.gather(*(node_info(state.connection(t), t.node)
                                       for t in primaries))
        return {"max_value_size": self.max_value_size,
                "nodes": {t.node: info for t, info in zip(primaries, infos)}}

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        """``SCAN MATCH`` on every primary in turn (each holds only its own slots)."""
        state, primaries = await self._primaries_now()
        for target in primaries:
            conn = state.connection(target)
            async for page in scan_node(conn, prefix, batch, f"cluster node {target.node}"):
                yield page

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``EXISTS`` per key, pipelined per owning node, nodes concurrently."""
        return await self._per_key([[pack_exists(k)] for k in keys], keys, False, exists)

    async def sizes_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """``STRLEN`` per key, pipelined per owning node, nodes concurrently."""
        return await self._per_key([[pack_strlen(k)] for k in keys], keys, None, size_of)
