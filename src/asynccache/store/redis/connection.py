"""Redis on the asyncio transport: a lean, pipelined RESP connection, parsed by hiredis.

Why not redis-py here: one ``MGET`` through ``redis.asyncio`` costs 80–170 µs of CPU
whatever its size (measured; docs/design.md, "Connections"), and read-ahead issues thousands
of them on a loop thread that shares the GIL with the training loop. This keeps only
what a cache needs: requests written back to back, replies handed back in order, one
timer per exchange, ``AUTH``/``SELECT`` on a new connection.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ..protocol.resp import (
    RespParser,
    check_mget_reply,
    pack_mget,
    setup_refused,
    unexpected_reply,
)
from ..transport.aio import AsyncConnection, PipelinedProtocol, StreamProtocol
from .endpoint import RedisEndpoint

#: One request: the buffers of one command, written back to back (values not copied).
Request = Sequence[bytes | memoryview]

__all__ = ["Request", "RespConnection"]


class _RespProtocol(StreamProtocol):
    endpoint: RedisEndpoint

    def __init__(self, endpoint: RedisEndpoint) -> None:
        super().__init__(endpoint)
        self.parser = RespParser()

    def unexpected(self, exc: Exception) -> Any:
        # a memcached server at this port: say which URL to use
        return unexpected_reply(self.endpoint.where, exc, self.endpoint.address)


class RespConnection(AsyncConnection):
    """One pipelined connection to a Redis-protocol server, opened lazily."""

    endpoint: RedisEndpoint

    def _protocol(self) -> PipelinedProtocol:
        return _RespProtocol(self.endpoint)

    async def _setup(self, proto: PipelinedProtocol) -> None:
        setup = self.endpoint.setup_requests()
        if setup:
            refused = setup_refused(self.endpoint.where,
                                    await self._send(proto, setup, len(setup)))
            if refused is not None:
                proto.fail(refused)
                raise refused

    async def execute(self, requests: Sequence[Request]) -> list[Any]:
        """Send every request pipelined; their replies in order (error replies included,
        as ``hiredis.ReplyError`` values). Idempotent commands only."""
        return await self.execute_packed(list(itertools.chain.from_iterable(requests)),
                                         len(requests))

    async def mget(self, chunks: Sequence[Sequence[bytes]]) -> list[bytes | None]:
        """Values of every key of every chunk, one pipelined MGET per chunk, in order."""
        replies = await self.execute([[pack_mget(chunk)] for chunk in chunks])
        out: list[bytes | None] = []
        where = self.endpoint.where
        for chunk, reply in zip(chunks, replies):
            out.extend(check_mget_reply(reply, where, len(chunk)))
        return out
