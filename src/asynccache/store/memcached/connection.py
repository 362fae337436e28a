"""memcached on the asyncio transport: one pipelined text-protocol connection per server.

Every reply is checked against the request it answers (the sans-IO parser of
`asynccache.store.protocol.memcache` is told what each request expects), so a reply
is only ever handed to its own request; a ``CLIENT_ERROR``/``ERROR`` (the stream may be
out of step) or bytes that cannot answer the oldest request close the connection.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ...errors import StoreError
from ..protocol.memcache import (
    ErrorReply,
    ProtocolViolation,
    Reply,
    ReplyParser,
    Request,
    not_understood,
    unexpected_reply,
)
from ..transport.aio import AsyncConnection, PipelinedProtocol, ReceivingProtocol
from ..transport.buffers import value_buffer
from ..transport.endpoint import Endpoint
from ..transport.tls import TlsSettings

__all__ = ["MemcachedConnection", "memcached_endpoint"]


def memcached_endpoint(host: str, port: int, *, tls: TlsSettings | None = None,
                       timeout: float = 1.0, connect_timeout: float = 1.0) -> Endpoint:
    """Where one memcached server is (``host:port`` in messages)."""
    where = f"{host}:{port}"
    return Endpoint(kind="memcached", where=where, host=host, port=port, tls=tls,
                    timeout=timeout, connect_timeout=connect_timeout,
                    tls_url=f"memcached://{where}?tls=true")


class _ScreenedParser:
    """The reply parser, with the replies that put the stream out of step raised."""

    __slots__ = ("buffer", "expect", "feed", "parser", "received", "where")

    def __init__(self, max_value: int, where: str) -> None:
        #: values of BIG_VALUE bytes or more arrive in memory of their own
        self.parser = ReplyParser(max_value, alloc=value_buffer)
        self.feed = self.parser.feed
        self.buffer = self.parser.buffer
        self.received = self.parser.received
        self.expect = self.parser.expect
        self.where = where

    def gets(self) -> Reply | bool:
        reply = self.parser.gets()
        if type(reply) is ErrorReply and not reply.in_sync:
            raise not_understood(self.where, reply)
        return reply


class _MemcachedProtocol(ReceivingProtocol):
    def __init__(self, endpoint: Endpoint, max_value: int) -> None:
        super().__init__(endpoint)
        self.parser = _ScreenedParser(max_value, endpoint.where)

    def expect(self, requests: Sequence[Any]) -> None:
        for request in requests:
            self.parser.expect(request)

    def unexpected(self, exc: Exception) -> StoreError:
        if isinstance(exc, ProtocolViolation):
            return unexpected_reply(self.endpoint.where, exc)
        return super().unexpected(exc)


class MemcachedConnection(AsyncConnection):
    """One pipelined connection to one memcached server, opened lazily, in one loop."""

    def __init__(self, endpoint: Endpoint, *, max_value: int) -> None:
        super().__init__(endpoint)
        self.max_value = max_value

    @property
    def where(self) -> str:
        return self.endpoint.where

    def _protocol(self) -> PipelinedProtocol:
        return _MemcachedProtocol(self.endpoint, self.max_value)

    async def execute(self, requests: Sequence[Request]) -> list[Reply]:
        """Send every request pipelined; their replies in order (``SERVER_ERROR`` replies
        included, as `ErrorReply` values). Idempotent commands only."""
        buffers = list(itertools.chain.from_iterable(r.buffers for r in requests))
        return await self.execute_packed(buffers, len(requests), requests)
