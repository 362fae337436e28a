"""Read-ahead on one memcached server: pipelined ``get``s on a consumer thread's own
socket (plain or TLS), on the blocking transport.

One `BlockingMemcachedConnection.send_get()` takes the store's keys as they are, maps them
with `safe_memcached_key()`, asks each distinct key once (memcached answers a repeated key
once per mention, so duplicates are folded and handed back to every position), and cuts the
request into ``get`` lines of at most ``max_batch`` keys; its reply is assembled from those
lines.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ...errors import StoreError
from ..api import NodeName, chunked
from ..protocol.memcache import (
    ProtocolViolation,
    ReplyParser,
    pack_get,
    safe_memcached_keys,
    unexpected_reply,
)
from ..transport.blocking import BlockingConnection, Request
from ..transport.buffers import value_buffer
from ..transport.endpoint import Endpoint

__all__ = ["BlockingMemcachedConnection"]


class _Get(Request):
    """One ``send_get``: its ``get`` lines, the replies parsed so far, and its deadline."""

    __slots__ = ("asked", "replies", "requests", "unique")

    def __init__(self, keys: Sequence[bytes], max_batch: int) -> None:
        safe = safe_memcached_keys(keys)
        self.unique = list(dict.fromkeys(safe))
        #: the memcached key of every position, kept only when some key repeats
        self.asked = safe if len(self.unique) != len(safe) else None
        self.requests = [pack_get(chunk) for chunk in chunked(self.unique, max_batch)]
        super().__init__(b"".join(itertools.chain.from_iterable(r.buffers
                                                                for r in self.requests)))
        self.replies: list[list[bytes | None]] = []

    @property
    def complete(self) -> bool:
        return len(self.replies) == len(self.requests)

    def values(self) -> list[bytes | None]:
        """One value per key asked, in the order asked."""
        if len(self.replies) == 1:
            flat = self.replies[0]
        else:
            flat = list(itertools.chain.from_iterable(self.replies))
        if self.asked is None:
            return flat
        found = dict(zip(self.unique, flat))
        return [found[key] for key in self.asked]


class BlockingMemcachedConnection(BlockingConnection):
    """One socket to one memcached server, many multi-gets in flight, replies in order."""

    #: large values are received each into memory of its own (`ReplyParser` ``alloc``)
    owns_buffers = True

    def __init__(self, endpoint: Endpoint, *, max_value: int, max_batch: int = 128,
                 node: NodeName | None = None) -> None:
        super().__init__(endpoint, node)
        self.max_value = max_value
        self.max_batch = max_batch

    def _request(self, keys: Sequence[bytes]) -> Request:
        return _Get(keys, self.max_batch)

    def _new_parser(self) -> Any:
        return ReplyParser(self.max_value, alloc=value_buffer)

    def _sent(self, request: Request) -> None:
        assert isinstance(request, _Get)
        request.replies.clear()  # sent again: on a fresh connection, with a fresh parser
        for line in request.requests:
            self.parser.expect(line)

    def _idle_closed(self) -> bool:
        """Also bytes nobody asked for (they would be read as the next request's)."""
        return bool(self.parser.buffered) or super()._idle_closed()

    def _parse(self) -> Any:
        """The oldest request's values once all its ``get`` lines were answered, else
        False."""
        get = self.pending[0]
        while not get.complete:
            try:
                reply = self.parser.gets()
            except ProtocolViolation as exc:
                raise unexpected_reply(self.endpoint.where, exc) from exc
            if reply is False:
                return False
            if not isinstance(reply, list):  # a get is answered with values or an error
                raise StoreError(f"memcached {self.endpoint.where} answered get with {reply!s}")
            get.replies.append(reply)
        return get.values()
