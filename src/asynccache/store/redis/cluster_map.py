"""A Redis Cluster as one event loop sees it: redis-py's slot map, one `ClusterNode` per
primary (its endpoint and the loop's pipelined connection to it), the map flattened for
the hot paths (`SlotView`), and its refreshes.

The client makes one `ClusterMap` per loop; the operations across nodes
(`cluster_calls`) and the consumer threads' routes (`cluster_consumer`) work on it and on
nothing of the client's, so none of them imports the client back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from ...errors import StoreError, StoreTimeout, StoreUnavailable
from ..api import NodeName
from ..protocol.resp import memcached_hint
from ..transport.endpoint import connect_failure
from ..transport.tls import TlsSettings, ssl_error_in
from .cluster_slots import NO_VIEW, SlotView, Target
from .connection import RespConnection
from .endpoint import RedisEndpoint

__all__ = ["REDIRECT_REFRESH_INTERVAL", "REFRESH_INTERVAL", "ClusterMap", "ClusterNode",
           "KnownPrimaries", "NodeAccess"]

logger = logging.getLogger("asynccache")

#: Least seconds between slot-map re-reads triggered by a node that did not answer: a dead
#: node is probed on every read that is not skipped, and each probe must not cost a
#: ``CLUSTER SLOTS``.
REFRESH_INTERVAL = 1.0
#: Least seconds between re-reads asked for by a redirection the consumer-side path saw
#: (it cannot follow one itself): a burst of ``MOVED`` replies costs one ``CLUSTER SLOTS``.
REDIRECT_REFRESH_INTERVAL = 0.1


@dataclass(frozen=True)
class NodeAccess:
    """How this client reaches any node of the cluster: what every `ClusterNode`'s
    endpoint and every map read share (credentials, TLS, timeouts). Made afresh for each
    loop's map and each consumer's routes: it holds the password, so it is never kept on
    the client (which pickles), and its repr leaves the password out."""

    safe_url: str
    username: str | None
    password: str | None = field(repr=False)
    tls: TlsSettings | None
    timeout: float
    connect_timeout: float
    max_batch: int

    def endpoint(self, host: str, port: int) -> RedisEndpoint:
        """Where a node is, and how to talk to it."""
        return RedisEndpoint(
            host=host, port=port, unix_socket_path=None, username=self.username,
            password=self.password, db=0, timeout=self.timeout,
            connect_timeout=self.connect_timeout, where=f"cluster node {host}:{port}",
            tls=self.tls)


class KnownPrimaries:
    """The primaries of the latest slot map any loop of this process read (what the
    client's ``node_names`` says): written by the maps, read from any thread."""

    __slots__ = ("names",)

    def __init__(self) -> None:
        self.names: tuple[NodeName, ...] = ()


class ClusterNode:
    """One node of the cluster as a loop uses it: its name (``host:port``, what its
    failures are reported under), where it is, and the pipelined connection to it."""

    __slots__ = ("conn", "endpoint", "name")

    def __init__(self, name: NodeName, endpoint: RedisEndpoint) -> None:
        self.name = name
        self.endpoint = endpoint
        self.conn = RespConnection(endpoint)

    def close(self) -> None:
        self.conn.close()


class ClusterMap:
    """redis-py's topology (the slot map only: no data goes through redis-py), one
    `ClusterNode` per primary, and the map as of the last read (`view`)."""

    def __init__(self, topology: RedisCluster, access: NodeAccess,
                 known: KnownPrimaries) -> None:
        self.topology = topology
        self.access = access
        #: told the primaries of each map read (the client's node_names)
        self.known = known
        self.nodes: dict[NodeName, ClusterNode] = {}
        self.ready = False  # the slot map was read once
        self.view: SlotView = NO_VIEW  # the slot map as of the last read
        self.refresh_task: asyncio.Task[None] | None = None  # re-read after a failure
        self.last_refresh = float("-inf")  # time.monotonic() of the last re-read started

    @property
    def safe_url(self) -> str:
        return self.access.safe_url

    @property
    def max_batch(self) -> int:
        return self.access.max_batch

    def connection(self, target: Target) -> RespConnection:
        """The node's connection. Every primary of the map has one; a redirection may
        name a node the map does not list yet, whose connection is closed at the next
        map refresh unless it is a primary by then."""
        node = self.nodes.get(target.node)
        if node is None:
            node = self.nodes[target.node] = ClusterNode(
                target.node, self.access.endpoint(target.host, target.port))
        return node.conn

    def primaries(self) -> list[Target]:
        """The primaries of redis-py's map now."""
        return [Target(NodeName(n.name), n.host, int(n.port))
                for n in self.topology.get_primaries()]

    def _sync_nodes(self) -> None:
        """One node per primary of the current map; close the others. Publish the map as
        a new `SlotView` (the read paths' lookups)."""
        primaries = {NodeName(n.name): n for n in self.topology.get_primaries()}
        for name in [name for name in self.nodes if name not in primaries]:
            self.nodes.pop(name).close()
        for name, node in primaries.items():
            if name not in self.nodes:
                self.nodes[name] = ClusterNode(
                    name, self.access.endpoint(node.host, int(node.port)))
        owners: list[NodeName | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        for slot, holders in self.topology.nodes_manager.slots_cache.items():
            if holders and holders[0].name in primaries:  # [0]: the slot's primary
                owners[slot] = NodeName(holders[0].name)
        self.view = SlotView(self.view.generation + 1, tuple(owners),
                             {name: (n.host, int(n.port)) for name, n in primaries.items()})
        self.known.names = tuple(primaries)

    async def load(self) -> None:
        """Read the slot map (``CLUSTER SLOTS`` from the first startup node that answers);
        raises StoreError when none does."""
        access = self.access
        budget = access.connect_timeout + access.timeout
        try:
            if self.ready:
                await asyncio.wait_for(self.topology.nodes_manager.initialize(), budget)
            else:
                await asyncio.wait_for(self.topology.initialize(), budget)
        except asyncio.TimeoutError as exc:
            raise StoreTimeout(f"redis cluster {access.safe_url} did not give its slot map "
                               f"within {budget:g}s") from exc
        except (rexc.RedisError, rexc.RedisClusterException, OSError) as exc:
            # RedisClusterException ("cannot be connected") is not a RedisError
            tls_error = ssl_error_in(exc)
            if tls_error is not None:  # say what TLS refused, not only "cannot connect"
                raise connect_failure("redis cluster", access.safe_url, tls_error,
                                      access.tls, access.connect_timeout) from exc
            hint = memcached_hint(exc, None)
            raise StoreUnavailable(f"cannot read the slot map of redis cluster "
                                   f"{access.safe_url}: {exc}{'; ' if hint else ''}{hint}"
                                   ) from exc
        self.ready = True
        self._sync_nodes()

    async def refresh(self) -> None:
        """Re-read the slot map; a failure only leaves the old map in place (logged)."""
        self.last_refresh = time.monotonic()
        try:
            await self.load()
        except StoreError as exc:
            logger.debug("asynccache: slot map refresh failed: %s", exc)

    def refresh_soon(self, interval: float = REFRESH_INTERVAL) -> None:
        """Re-read the map in the background, at most once per ``interval``."""
        if self.refresh_task is not None and not self.refresh_task.done():
            return
        if time.monotonic() - self.last_refresh < interval:
            return
        self.refresh_task = asyncio.ensure_future(self.refresh())

    async def close(self) -> None:
        if self.refresh_task is not None:
            self.refresh_task.cancel()
            await asyncio.gather(self.refresh_task, return_exceptions=True)
        for node in self.nodes.values():
            node.close()
        self.nodes.clear()
        await self.topology.aclose()
