"""Read-ahead on a Redis Cluster: pipelined ``GET``s on one consumer-thread socket per
primary (the Redis connection on the blocking transport), and `UnservedKeys` for keys no
connection serves.

A request to a node is one ``GET`` per key (a multi-key ``MGET`` must stay within one
slot), and its replies are gathered into one list, so the prefetcher sees one reply per
node and per request, as from a single server. A ``GET`` answered with ``MOVED``/``ASK``,
``CLUSTERDOWN`` or another error fails the request like a broken connection: the
connection is dropped with everything on its wire (those keys are read again, directly,
when asked for), and ``trouble`` asks the loop thread to re-read the slot map. Replies
already parsed in the same `BlockingClusterConnection.poll()` are handed back first;
the failure is raised by the next call.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import hiredis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from ..._interrupts import raised_in_signal_handler
from ...errors import StoreError, StoreTimeout, StoreUnavailable
from ..api import AnsweredAtSend, ConsumerConnection, NodeName, ReadResult
from ..loop import LoopThread
from ..protocol.resp import cluster_node_error, pack_gets, unexpected_reply
from ..transport.blocking import Request
from .cluster_map import NodeAccess
from .cluster_slots import NO_VIEW, SlotView, key_slots
from .consumer import BlockingRespConnection
from .endpoint import RedisEndpoint

__all__ = ["BlockingClusterConnection", "ConsumerRoutes", "Trouble", "UnservedKeys"]

logger = logging.getLogger("asynccache")

#: ``trouble(node, redirected)``: the node answered a redirection (True) or could not be
#: reached or could not serve (False); the slot map may be stale. Called on the consumer
#: thread; it must not block.
Trouble = Callable[[str, bool], None]

#: A connection that answered less than this many seconds ago is not checked for an idle
#: close before a send (a ``poll()`` per send, per node): servers close idle connections
#: after whole seconds, and a close missed anyway is met by the one silent resend.
IDLE_CHECK_AFTER = 0.5

_ReplyError = hiredis.ReplyError


class BlockingClusterConnection(BlockingRespConnection):
    """One cluster node's socket: each request is a ``GET`` per key, answered as one list.

    ``endpoint`` may be None for a connection not assigned to a node yet (the routing
    keeps a few spare ones for nodes that join the map later): it is never sent to
    until `retarget()` gives it one.
    """

    def __init__(self, endpoint: RedisEndpoint | None, node: str, trouble: Trouble) -> None:
        super().__init__(endpoint, NodeName(node))  # type: ignore[arg-type]
        self.trouble = trouble
        self._got: list[Any] = []      # replies of the oldest request gathered so far
        self._polling = False
        self._returned = 0             # replies handed back by the current poll()
        self._deferred: StoreError | None = None  # raised by the next call
        self._active = 0.0  # time.monotonic() of the last reply

    def retarget(self, endpoint: RedisEndpoint, node: str) -> None:
        """Serve another node from now on (only while nothing is pending)."""
        self._fail()
        self.endpoint, self.node = endpoint, NodeName(node)

    # -- requests -----------------------------------------------------------------------
    def _request(self, keys: Sequence[bytes]) -> Request:
        # a GET per key, answered by ``count`` replies gathered into one list; GETs stay
        # on hiredis: no parser switch
        return Request(pack_gets(keys), len(keys))

    def _idle_closed(self) -> bool:
        return time.monotonic() - self._active > IDLE_CHECK_AFTER and super()._idle_closed()

    def send_get(self, keys: Sequence[bytes]) -> None:
        if self._deferred is not None:
            raise self._take_deferred()
        try:
            super().send_get(keys)
        except (StoreUnavailable, StoreTimeout):
            self.trouble(self.node, False)
            raise

    def _connect(self) -> None:
        self._got = []  # a fresh parser: the gathered replies are void
        super()._connect()

    # -- replies ------------------------------------------------------------------------
    def poll(self, limit: int | None = None) -> list[list[Any]]:
        if self._deferred is not None:
            raise self._take_deferred()
        self._polling, self._returned = True, 0
        try:
            return super().poll(limit)
        except (StoreUnavailable, StoreTimeout):
            self.trouble(self.node, False)
            raise
        finally:
            self._polling = False

    def receive(self) -> list[Any]:
        if self._deferred is not None:
            raise self._take_deferred()
        try:
            return super().receive()
        except (StoreUnavailable, StoreTimeout):
            self.trouble(self.node, False)
            raise

    def _parse(self) -> Any:
        """The oldest request's replies as one list once all have arrived, else False;
        raises (or, inside a poll that already parsed a reply, defers) the failure a
        reply that is not a value means."""
        need, got, gets = self.pending[0].count, self._got, self.parser.gets
        try:
            while len(got) < need:
                reply = gets()
                if reply is False:
                    return False
                got.append(reply)
        except Exception as exc:  # hiredis.ProtocolError
            if raised_in_signal_handler(exc):
                raise
            raise unexpected_reply(self.endpoint.where, exc, self.endpoint.address) from exc
        self._got = []
        if _ReplyError in map(type, got):
            error = self._failure(got)
            if self._polling and self._returned:
                self._deferred = error
                return False
            raise error
        if self._polling:
            self._returned += 1
        return got

    def _accept(self, reply: Any) -> list[Any]:
        self._active = time.monotonic()
        return super()._accept(reply)

    def _failure(self, replies: list[Any]) -> StoreError:
        reply = next(r for r in replies if type(r) is _ReplyError)
        text, node = str(reply), self.node
        if text.startswith(("MOVED ", "ASK ")):
            self.trouble(node, True)
            return StoreError(
                f"redis cluster node {node} redirected a key ({text}): the slot map is "
                "being re-read; the keys of that request were not read (they are read "
                "again, from the new owner, when asked for)")
        error = cluster_node_error(text, node)
        if error is None:
            return StoreError(f"redis cluster node {node} answered GET with an error: {text}")
        if isinstance(error, StoreUnavailable):
            self.trouble(node, False)
        return error

    def _take_deferred(self) -> StoreError:
        error, self._deferred = self._deferred, None
        self._fail()
        assert error is not None
        return error

    def _fail(self) -> None:
        super()._fail()
        self._got = []


class UnservedKeys(AnsweredAtSend):
    """Where the routing sends keys it has no connection for: no map was read yet, a
    slot no node serves, a node that joined when no spare connection was left. Rare, so
    these go through the asyncio path on the loop thread, which reads (or re-reads) the
    map as it does for any read, follows redirections and reports what failed: ``read``
    returns the values, or raises the failure (those keys are then not read).

    ``name()`` is the node such failures count under (the failure policy backs it off
    alone)."""

    def __init__(self, name: Callable[[], str],
                 read: Callable[[Sequence[bytes]], list[Any]]) -> None:
        super().__init__()
        self.name = name
        self._read = read

    @property
    def node(self) -> NodeName:  # type: ignore[override]
        return NodeName(self.name())

    def read(self, keys: Sequence[bytes]) -> list[Any]:
        return self._read(keys)


class ConsumerRoutes:
    """``route(keys)`` for one consumer thread's reader (read-ahead on its own sockets),
    and its connections: one `BlockingClusterConnection` per primary.

    The map is the one the loop thread's state keeps (redis-py's, as a
    `SlotView`); each request looks at its generation, and a new one (after a
    ``MOVED``, a failover, a node that left) is followed there and then: connections of
    nodes that left the map are closed and given to the nodes that joined it. The list
    of connections cannot grow once handed out (the source sized its state by it), so it
    holds spares: twice as many as there are primaries now (at least six). Keys of a
    slot no node serves, of a node no spare is left for, or all keys while no map could
    be read yet, go to `UnservedKeys`: the asyncio path reads them (loading the
    map if need be), and what fails there fails only them.
    """

    def __init__(self, access: NodeAccess, loop: LoopThread, primaries: int,
                 view: Callable[[], SlotView | None], refresh: Callable[[bool], None],
                 read: Callable[[list[bytes]], Coroutine[Any, Any, ReadResult]]) -> None:
        """``view()``: the slot map of ``loop``'s state now (None before it has one);
        ``refresh(redirected)``: (loop thread) re-read it soon; ``read(keys)``: the asyncio
        path's read, for keys no connection here serves."""
        self.access = access
        self.loop = loop
        self._view = view
        self._refresh = refresh
        self._read = read
        capacity = 2 * max(primaries, 3)
        self.conns: list[ConsumerConnection] = [
            BlockingClusterConnection(None, f"(spare {i})", self.trouble)
            for i in range(capacity)]
        self.unserved = capacity
        self.conns.append(UnservedKeys(self._unserved_name, self._read_on_loop))
        self.generation = -1
        self.owner_of: list[int] = [self.unserved] * REDIS_CLUSTER_HASH_SLOTS
        self.incomplete = False  # a primary of the map is still without a connection

    def trouble(self, node: str, redirected: bool) -> None:
        """(Consumer thread.) Ask the loop thread to re-read the map."""
        try:
            self.loop.call_soon(self._refresh, redirected)
        except RuntimeError:  # the loop is closed: nothing to refresh for
            pass

    def _unserved_name(self) -> str:
        """Where keys without a connection count their failures: the cluster's URL
        before any map was read (as the asyncio path reports it), else the slots no
        node serves."""
        view = self._view()
        url = self.access.safe_url
        if view is None or view is NO_VIEW:
            return url
        return f"{url} (slots no node serves)"

    def _read_on_loop(self, keys: Sequence[bytes]) -> list[Any]:
        """(Consumer thread.) ``keys`` read by the asyncio path; raises what failed."""
        access = self.access
        budget = access.connect_timeout + 2 * access.timeout + 1
        try:
            result = self.loop.call(self._read(list(keys)), budget)
        except concurrent.futures.TimeoutError as exc:
            raise StoreTimeout(f"redis cluster {access.safe_url} did not answer within "
                               f"{budget:g}s") from exc
        except RuntimeError as exc:  # the loop is closed
            raise StoreUnavailable(f"redis cluster {access.safe_url}: {exc}") from exc
        for error in result.failures.values():
            raise error
        if result.skipped:  # not skipped here: only the policy skips, before send_get
            raise StoreError("keys skipped by the cluster client (asynccache bug)")
        return result.values

    def route(self, keys: Sequence[bytes]) -> list[tuple[int, list[int]]]:
        view = self._view()
        if view is not None and (view.generation != self.generation or (
                self.incomplete and self._any_free(view))):
            self._follow(view)
        owner_of = self.owner_of
        groups: dict[int, list[int]] = {}
        for position, ci in enumerate([owner_of[slot] for slot in key_slots(keys)]):
            group = groups.get(ci)
            if group is None:
                groups[ci] = [position]
            else:
                group.append(position)
        return list(groups.items())

    def _real(self) -> list[BlockingClusterConnection]:
        return self.conns[: self.unserved]  # type: ignore[return-value]

    def _any_free(self, view: SlotView) -> bool:
        return any(c.endpoint is None or (c.node not in view.primaries and not c.pending)
                   for c in self._real())

    def _follow(self, view: SlotView) -> None:
        """Connections for the primaries of ``view``, and the slot → connection lookup."""
        primaries = view.primaries
        conns = self._real()
        index = {c.node: ci for ci, c in enumerate(conns)
                 if c.endpoint is not None and c.node in primaries}
        free = []
        for ci, conn in enumerate(conns):
            if conn.endpoint is None or (conn.node not in primaries and not conn.pending):
                conn.close()
                free.append(ci)
        self.incomplete = False
        for name, (host, port) in primaries.items():
            if name in index:
                continue
            if not free:
                self.incomplete = True
                logger.debug("asynccache: no consumer connection left for cluster node %s",
                             name)
                continue
            ci = free.pop(0)
            conns[ci].retarget(self.access.endpoint(host, port), name)
            index[name] = ci
        unserved = self.unserved
        lookup = {name: index.get(name, unserved) for name in primaries}
        self.owner_of = [unserved if name is None else lookup[name] for name in view.owners]
        self.generation = view.generation
