"""Read-ahead on a Redis Cluster: pipelined ``GET`` s on one consumer-thread socket per
primary (the Redis connection on the blocking transport), and :class:`UnservedKeys` for
keys no connection serves.

A request to a node is one ``GET`` per key (a multi-key ``MGET`` must stay within one
slot), and its replies are gathered into one list, so the prefetcher sees one reply per
node and per request, as from a single server. A ``GET`` answered with ``MOVED``/``ASK``,
``CLUSTERDOWN`` or another error fails the request like a broken connection: the
connection is dropped with everything on its wire (those keys are read again, directly,
when asked for), and ``trouble`` asks the loop thread to re-read the slot map. Replies
already parsed in the same :meth:`~BlockingClusterConnection.poll` are handed back first;
the failure is raised by the next call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import hiredis

from ...errors import StoreError, StoreTimeout, StoreUnavailable
from ..api import AnsweredAtSend, NodeName
from ..protocol.resp import cluster_node_error, pack_gets, unexpected_reply
from ..transport.blocking import Request
from .endpoint import RedisEndpoint
from .reads import BlockingRespConnection

__all__ = ["BlockingClusterConnection", "Trouble", "UnservedKeys"]

#: ``trouble(node, redirected)``: the node answered a redirection (True) or could not be
#: reached or could not serve (False); the slot map may be stale. Called on the consumer
#: thread; it must not block.
Trouble = Callable[[str, bool], None]

#: A connection that answered less than this many seconds ago is not checked for an idle
#: close before a send (a ``poll()`` per send, per node): servers close idle connections
#: after whole seconds, and a close missed anyway is met by the one silent resend.
IDLE_CHECK_AFTER = 0.5

_ReplyError = hiredis.ReplyError


class _Gets(Request):
    """``n`` pipelined ``GET`` s, answered by ``n`` replies gathered into one list."""

    __slots__ = ("n",)

    def __init__(self, keys: Sequence[bytes]) -> None:
        super().__init__(pack_gets(keys))
        self.n = len(keys)


class BlockingClusterConnection(BlockingRespConnection):
    """One cluster node's socket: each request is a ``GET`` per key, answered as one list.

    ``endpoint`` may be None for a connection not assigned to a node yet (the routing
    keeps a few spare ones for nodes that join the map later): it is never sent to
    until :meth:`retarget` gives it one.
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
        return _Gets(keys)  # GETs stay on hiredis: no parser switch

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
        need, got, gets = self.pending[0].n, self._got, self.parser.gets
        try:
            while len(got) < need:
                reply = gets()
                if reply is False:
                    return False
                got.append(reply)
        except Exception as exc:  # hiredis.ProtocolError
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

    @property  # type: ignore[override]
    def node(self) -> NodeName:
        return NodeName(self.name())

    def read(self, keys: Sequence[bytes]) -> list[Any]:
        return self._read(keys)
