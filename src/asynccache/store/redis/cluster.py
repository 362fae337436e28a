"""Redis Cluster on the lean RESP path: redis-py keeps the slot map, every byte of data
goes over one pipelined `RespConnection` per primary.

Why it is built this way: docs/design.md, "Redis Cluster".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any

import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from ...errors import CacheError, StoreError, StoreTimeout, StoreUnavailable
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
from ..protocol.resp import (
    PING,
    is_error,
    memcached_hint,
    pack_delete,
    pack_set,
    pack_set_if_absent,
)
from ..transport.endpoint import connect_failure
from ..transport.tls import TlsSettings, ssl_error_in
from .admin import node_info, pack_exists, pack_strlen, scan_node
from .cluster_calls import Add, Delete, Exists, Read, Sizes, Write
from .cluster_reads import ConsumerRoutes
from .cluster_slots import ClusterState, Command, SlotView, Target, key_slots
from .connection import RespConnection
from .endpoint import RedisEndpoint

__all__ = ["RedisClusterClient"]

logger = logging.getLogger("asynccache")

#: Least seconds between slot-map re-reads triggered by a node that did not answer: a dead
#: node is probed on every read that is not skipped, and each probe must not cost a
#: ``CLUSTER SLOTS``.
REFRESH_INTERVAL = 1.0
#: Least seconds between re-reads asked for by a redirection the consumer-side path saw
#: (it cannot follow one itself): a burst of ``MOVED`` replies costs one ``CLUSTER SLOTS``.
REDIRECT_REFRESH_INTERVAL = 0.1


class RedisClusterClient(BaseClient[ClusterState]):
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
        self._primaries: tuple[NodeName, ...] = ()

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
        return self._primaries or tuple(NodeName(f"{h}:{p}") for h, p in self.nodes)

    # -- per-loop state: the slot map and one connection per primary -------------------
    def _open_state(self) -> ClusterState:
        topology = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
            # a slot nobody serves costs its own keys, not the whole map
            require_full_coverage=False,
            username=self.username,
            password=self.password,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.connect_timeout,
            **(self.tls.redis_py_options() if self.tls else {}),
        )
        return ClusterState(topology)

    async def _close_state(self, state: ClusterState) -> None:
        if state.refresh is not None:
            state.refresh.cancel()
            await asyncio.gather(state.refresh, return_exceptions=True)
        for conn in state.nodes.values():
            conn.close()
        state.nodes.clear()
        await state.topology.aclose()

    def _endpoint(self, host: str, port: int) -> RedisEndpoint:
        return RedisEndpoint(
            host=host, port=port, unix_socket_path=None, username=self.username,
            password=self.password, db=0, timeout=self.timeout,
            connect_timeout=self.connect_timeout, where=f"cluster node {host}:{port}",
            tls=self.tls)

    def _connection(self, state: ClusterState, target: Target) -> RespConnection:
        """The node's connection. Every primary of the map has one; a redirection may
        name a node the map does not list yet, whose connection is closed at the next
        map refresh unless it is a primary by then."""
        conn = state.nodes.get(target.node)
        if conn is None:
            conn = RespConnection(self._endpoint(target.host, target.port))
            state.nodes[target.node] = conn
        return conn

    def _sync_nodes(self, state: ClusterState) -> None:
        """One connection per primary of the current map; close the others. Publish the
        map as a new `SlotView` (the read paths' lookups)."""
        primaries = {NodeName(n.name): n for n in state.topology.get_primaries()}
        for name in [name for name in state.nodes if name not in primaries]:
            state.nodes.pop(name).close()
        for name, node in primaries.items():
            if name not in state.nodes:
                state.nodes[name] = RespConnection(self._endpoint(node.host, int(node.port)))
        owners: list[NodeName | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        for slot, holders in state.topology.nodes_manager.slots_cache.items():
            if holders and holders[0].name in primaries:  # [0]: the slot's primary
                owners[slot] = NodeName(holders[0].name)
        state.view = SlotView(state.view.generation + 1, tuple(owners),
                               {name: (n.host, int(n.port)) for name, n in primaries.items()})
        self._primaries = tuple(primaries)

    async def _load_map(self, state: ClusterState) -> None:
        """Read the slot map (``CLUSTER SLOTS`` from the first startup node that answers);
        raises StoreError when none does."""
        budget = self.connect_timeout + self.timeout
        try:
            if state.ready:
                await asyncio.wait_for(state.topology.nodes_manager.initialize(), budget)
            else:
                await asyncio.wait_for(state.topology.initialize(), budget)
        except asyncio.TimeoutError as exc:
            raise StoreTimeout(f"redis cluster {self.safe_url} did not give its slot map "
                               f"within {budget:g}s") from exc
        except (rexc.RedisError, rexc.RedisClusterException, OSError) as exc:
            # RedisClusterException ("cannot be connected") is not a RedisError
            tls_error = ssl_error_in(exc)
            if tls_error is not None:  # say what TLS refused, not only "cannot connect"
                raise connect_failure("redis cluster", self.safe_url, tls_error, self.tls,
                                      self.connect_timeout) from exc
            hint = memcached_hint(exc, None)
            raise StoreUnavailable(f"cannot read the slot map of redis cluster "
                                   f"{self.safe_url}: {exc}{'; ' if hint else ''}{hint}"
                                   ) from exc
        state.ready = True
        self._sync_nodes(state)

    async def _refresh(self, state: ClusterState) -> None:
        """Re-read the slot map; a failure only leaves the old map in place (logged)."""
        state.last_refresh = time.monotonic()
        try:
            await self._load_map(state)
        except StoreError as exc:
            logger.debug("asynccache: slot map refresh failed: %s", exc)

    def _refresh_soon(self, state: ClusterState, interval: float = REFRESH_INTERVAL) -> None:
        """Re-read the map in the background, at most once per ``interval``."""
        if state.refresh is not None and not state.refresh.done():
            return
        if time.monotonic() - state.last_refresh < interval:
            return
        state.refresh = asyncio.ensure_future(self._refresh(state))

    def _consumer_trouble(self, redirected: bool) -> None:
        """(Loop thread.) A consumer-side connection saw a redirection, or a node that
        cannot serve: re-read the map soon (the consumers' routing follows it)."""
        try:
            state = self._state()
        except RuntimeError:  # the loop is shutting down
            return
        self._refresh_soon(state, REDIRECT_REFRESH_INTERVAL if redirected else REFRESH_INTERVAL)

    async def _loaded_state(self) -> ClusterState:
        """(Loop thread.) This loop's state, its map read if any startup node answers."""
        state = self._state()
        if not state.ready:
            try:
                await self._load_map(state)
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
        routes = ConsumerRoutes(self, loop)
        return ConsumerReads(routes.conns, routes.route,
                             fanout=max(1, len(self.node_names)))

    async def _ready(self) -> ClusterState:
        state = self._state()
        if not state.ready:
            await self._load_map(state)
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
        call = Read(self, state, skip, len(keys))
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
        call = Write(self, state, skip, items)
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
        call = Delete(self, await self._ready(), ())
        await call.run(self._multi_key(keys, pack_delete))
        for error in call.failures.values():
            raise error

    async def ping(self) -> None:
        """``PING`` every primary of the slot map, concurrently."""
        state = await self._ready()
        primaries = [Target(NodeName(n.name), n.host, int(n.port))
                     for n in state.topology.get_primaries()]
        replies = await asyncio.gather(
            *(self._connection(state, target).execute([[PING]]) for target in primaries),
            return_exceptions=True)
        for target, reply in zip(primaries, replies):
            if isinstance(reply, BaseException):
                raise reply
            if is_error(reply[0]):
                raise StoreError(f"redis cluster node {target.node} answered PING with "
                                 f"{reply[0]}")

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        items = list(entries.items())
        call = Add(self, await self._ready(), len(items))
        ttl_ms = max(1, int(ttl * 1000))
        await call.run([Command(key_slot(key), [i], pack_set_if_absent(key, value, ttl_ms))
                        for i, (key, value) in enumerate(items)])
        for error in call.failures.values():
            raise error
        return call.added

    # -- administration -------------------------------------------------------------------
    async def _primaries_now(self) -> tuple[ClusterState, list[Target]]:
        state = await self._ready()
        return state, [Target(NodeName(n.name), n.host, int(n.port))
                       for n in state.topology.get_primaries()]

    async def server_info(self) -> dict[str, Any]:
        """Every primary's server, version, item size and memory, concurrently."""
        state, primaries = await self._primaries_now()
        infos = await asyncio.gather(*(node_info(self._connection(state, t), t.node)
                                       for t in primaries))
        return {"max_value_size": self.max_value_size,
                "nodes": {t.node: info for t, info in zip(primaries, infos)}}

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        """``SCAN MATCH`` on every primary in turn (each holds only its own slots)."""
        state, primaries = await self._primaries_now()
        for target in primaries:
            conn = self._connection(state, target)
            async for page in scan_node(conn, prefix, batch, f"cluster node {target.node}"):
                yield page

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``EXISTS`` per key, pipelined per owning node, nodes concurrently."""
        call = Exists(self, await self._ready(), len(keys))
        if keys:
            await call.run([Command(key_slot(key), [i], [pack_exists(key)])
                            for i, key in enumerate(keys)])
        for error in call.failures.values():
            raise error
        return call.found

    async def sizes_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """``STRLEN`` per key, pipelined per owning node, nodes concurrently."""
        call = Sizes(self, await self._ready(), len(keys))
        if keys:
            await call.run([Command(key_slot(key), [i], [pack_strlen(key)])
                            for i, key in enumerate(keys)])
        for error in call.failures.values():
            raise error
        return call.sizes
