"""Read-ahead on one Redis server: pipelined ``MGET``s on a consumer thread's own socket
(plain, TLS or unix), on the blocking transport.

Replies of small values are parsed by hiredis; once the values a connection reads are large
(an estimate of the replies' first values past ``BIG_VALUE``) they are parsed by
`BulkReader`, which receives each large value straight into a buffer of its own. The switch
happens at a reply boundary, about once per connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._interrupts import raised_in_signal_handler
from ...errors import StoreError, StoreUnavailable
from ..api import NodeName
from ..protocol.resp import RespParser, check_mget_reply, pack_mget, setup_refused, unexpected_reply
from ..protocol.resp_bulk import MAX_VALUE, BulkReader, ValueSizes
from ..transport.blocking import BlockingConnection, Closed, Request
from ..transport.buffers import value_buffer
from .endpoint import RedisEndpoint

__all__ = ["BlockingRespConnection"]



class BlockingRespConnection(BlockingConnection):
    """One socket, many MGETs in flight, replies matched to requests in order."""

    endpoint: RedisEndpoint
    #: large values are received each into memory of its own (`BulkReader`)
    owns_buffers = True

    def __init__(self, endpoint: RedisEndpoint, node: NodeName | None = None) -> None:
        super().__init__(endpoint, node)
        #: large values (an estimate of the replies' first values >= BIG_VALUE) are read
        #: by a BulkReader, each into its own buffer; small ones by hiredis
        self.big = False
        self.sizes = ValueSizes()

    def _request(self, keys: Sequence[bytes]) -> Request:
        packed = pack_mget(keys)
        if self.big != self.sizes.big(self.big):
            self._switch_parser()
        return Request(packed, len(keys))

    def _new_parser(self) -> Any:
        return RespParser()  # setup replies are hiredis': AUTH, SELECT are not MGETs

    def _setup(self, deadline: float) -> None:
        ep = self.endpoint
        for request in ep.setup_requests():
            self._write(request, deadline)
            try:
                reply = self._read_one(deadline, "answer", self._parse_resp)
            except Closed as exc:
                raise StoreUnavailable(f"redis {ep.where} closed the connection during setup"
                                       f"{ep.closed_hint(not self._answered)}") from exc
            refused = setup_refused(ep.where, [reply])
            self._answered = True
            if refused is not None:
                raise refused
        if self.big:
            self.parser = self._mget_parser()

    def _mget_parser(self) -> Any:
        return (BulkReader(max_value=MAX_VALUE, alloc=value_buffer) if self.big
                else RespParser())

    def _switch_parser(self) -> None:
        """Change parsers at a reply boundary: receive what is pending first (into
        ``stash``, handed out in order by poll/receive), so that no reply is split
        between the two."""
        while self.pending:
            self.stash.append(self._next_reply())
        leftover = self.sock is not None and not self.parser.idle
        self.big = not self.big
        if leftover:  # bytes nobody asked for: the stream cannot be trusted
            self._fail()
            raise StoreError(f"redis {self.endpoint.where} sent bytes no request asked for")
        if self.sock is not None:
            self.parser = self._mget_parser()

    def _parse_resp(self) -> Any:
        try:
            return self.parser.gets()
        except Exception as exc:  # hiredis.ProtocolError
            if raised_in_signal_handler(exc):
                raise
            raise unexpected_reply(self.endpoint.where, exc, self.endpoint.address) from exc

    _parse = _parse_resp

    def _accept(self, reply: Any) -> list[Any]:
        count = self.pending[0].count
        super()._accept(reply)
        values = check_mget_reply(reply, self.endpoint.where, count)
        self.sizes.observe(values)
        return values
