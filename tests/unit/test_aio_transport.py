"""The asyncio connection (`asynccache.store.transport.aio`) against a scripted transport:
no server, no socket. Each test says what the server sends and when; the connection must
hand every reply to the exchange that asked for it, in order, whatever the pieces, a
caller that gave up, a reply nobody asked for, a close or a silence."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

import asynccache as ac
from asynccache.store.transport.aio import AsyncConnection, PipelinedProtocol, StreamProtocol
from asynccache.store.transport.endpoint import Endpoint


class LineParser:
    """A reply is one line; a line ``BAD`` is bytes that cannot be a reply."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def gets(self) -> bytes | bool:
        line, sep, rest = self.buffer.partition(b"\n")
        if not sep:
            return False
        self.buffer = rest
        if line == b"BAD":
            raise ValueError("not a reply")
        return line


class LineProtocol(StreamProtocol):
    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(endpoint)
        self.parser = LineParser()


class ScriptedTransport(asyncio.Transport):
    """Records what is written; closing it tells the protocol, as a loop does."""

    def __init__(self, proto: PipelinedProtocol) -> None:
        super().__init__()
        self.proto = proto
        self.written: list[bytes] = []
        self.closed = False

    def writelines(self, buffers: Any) -> None:
        self.written.extend(bytes(b) for b in buffers)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.proto.connection_lost, None)

    def server_says(self, data: bytes) -> None:
        self.proto.data_received(data)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ScriptedEndpoint(Endpoint):
    """Connects to a `ScriptedTransport` instead of a server."""

    transports: list[ScriptedTransport] = field(default_factory=list)

    async def open_connection(self, protocol: Callable[[], asyncio.BaseProtocol]) -> None:
        proto = protocol()
        transport = ScriptedTransport(proto)  # type: ignore[arg-type]
        self.transports.append(transport)
        proto.connection_made(transport)


class LineConnection(AsyncConnection):
    def _protocol(self) -> PipelinedProtocol:
        return LineProtocol(self.endpoint)


def run(test: Callable[[LineConnection, ScriptedEndpoint], Coroutine[Any, Any, None]],
        timeout: float = 5.0) -> None:
    endpoint = ScriptedEndpoint(kind="lines", where="scripted", timeout=timeout)
    asyncio.run(test(LineConnection(endpoint), endpoint))


def ask(conn: LineConnection, *commands: bytes) -> asyncio.Task[list[Any]]:
    return asyncio.ensure_future(conn.execute_packed(list(commands), len(commands)))


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the connection never got there")


def test_pipelined_exchanges_get_their_own_replies_whatever_the_pieces() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        first = ask(conn, b"a", b"b")
        await until(lambda: bool(endpoint.transports and endpoint.transports[0].written))
        second = ask(conn, b"c")
        await until(lambda: len(endpoint.transports[0].written) == 3)
        server = endpoint.transports[0]
        for piece in (b"r", b"a\nr", b"b\nrc", b"\n"):  # replies cut anywhere
            server.server_says(piece)
        assert await first == [b"ra", b"rb"]
        assert await second == [b"rc"]
        assert len(endpoint.transports) == 1  # one connection, pipelined

    run(test)


def test_a_caller_that_gives_up_leaves_its_slot_for_its_late_reply() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        gave_up = ask(conn, b"slow")
        await until(lambda: bool(endpoint.transports and endpoint.transports[0].written))
        gave_up.cancel()
        later = ask(conn, b"next")
        await until(lambda: len(endpoint.transports[0].written) == 2)
        endpoint.transports[0].server_says(b"slow reply\nnext reply\n")
        assert await later == [b"next reply"]  # never the abandoned exchange's reply

    run(test)


def test_a_reply_nobody_asked_for_fails_the_connection() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        one = ask(conn, b"one")
        await until(lambda: bool(endpoint.transports and endpoint.transports[0].written))
        server = endpoint.transports[0]
        server.server_says(b"r1\nextra\n")
        assert await one == [b"r1"]
        assert server.closed  # its stream is not what was asked for: never used again
        two = ask(conn, b"two")
        await until(lambda: len(endpoint.transports) == 2 and bool(endpoint.transports[1].written))
        endpoint.transports[1].server_says(b"r2\n")
        assert await two == [b"r2"]

    run(test)


def test_bytes_that_are_not_a_reply_fail_every_waiter() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        first = ask(conn, b"a")
        await until(lambda: bool(endpoint.transports))
        second = ask(conn, b"b")
        await until(lambda: len(endpoint.transports[0].written) == 2)
        endpoint.transports[0].server_says(b"BAD\n")
        for waiter in (first, second):
            with pytest.raises(ac.StoreError, match="lines scripted sent an unexpected reply"):
                await waiter
        assert endpoint.transports[0].closed

    run(test)


def test_a_silent_server_is_a_timeout_and_the_connection_is_closed() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        with pytest.raises(ac.StoreTimeout, match=r"did not answer within 0\.05s"):
            await ask(conn, b"anyone?")
        assert endpoint.transports[0].closed

    run(test, timeout=0.05)


def test_an_idle_connection_closed_by_the_server_is_used_once_more_fresh() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        first = ask(conn, b"a")
        await until(lambda: bool(endpoint.transports and endpoint.transports[0].written))
        endpoint.transports[0].server_says(b"ra\n")
        assert await first == [b"ra"]
        sent = conn.send_now([b"b"], 1)  # on the idle connection, as far as we know...
        assert sent is not None and endpoint.transports[0].written == [b"a", b"b"]
        endpoint.transports[0].close()  # ...which the server had closed: no reply comes
        again = asyncio.ensure_future(conn.result(sent))
        await until(lambda: len(endpoint.transports) == 2 and bool(endpoint.transports[1].written))
        endpoint.transports[1].server_says(b"rb\n")
        assert await again == [b"rb"]
        assert endpoint.transports[1].written == [b"b"]  # sent once on the fresh one

    run(test)


def test_a_close_after_replies_began_is_not_resent() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        both = ask(conn, b"a", b"b")
        await until(lambda: len(endpoint.transports[0].written) == 2 if endpoint.transports
                    else False)
        server = endpoint.transports[0]
        server.server_says(b"ra\n")  # one of two replies, then the connection drops
        server.close()
        with pytest.raises(ac.StoreUnavailable, match="lines connection to scripted was closed"):
            await both
        assert len(endpoint.transports) == 1  # not sent again: a reply had come

    run(test)


def test_a_retired_connection_closes_once_its_last_reply_is_in() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        pending = ask(conn, b"a")
        await until(lambda: bool(endpoint.transports and endpoint.transports[0].written))
        server = endpoint.transports[0]
        server.proto.retire()
        assert not server.closed  # a reply is still to come
        server.server_says(b"ra\n")
        assert await pending == [b"ra"]
        assert server.closed

    run(test)


def _sequence(replies: Sequence[bytes]) -> bytes:
    return b"".join(r + b"\n" for r in replies)


def test_many_exchanges_in_flight_each_get_theirs() -> None:
    async def test(conn: LineConnection, endpoint: ScriptedEndpoint) -> None:
        first = ask(conn, b"0")
        await until(lambda: bool(endpoint.transports))
        rest = [ask(conn, *[b"%d.%d" % (i, j) for j in range(i % 3 + 1)]) for i in range(1, 40)]
        await until(lambda: len(endpoint.transports[0].written) == 1 + sum(
            i % 3 + 1 for i in range(1, 40)))
        written = endpoint.transports[0].written
        endpoint.transports[0].server_says(_sequence([b"re:" + w for w in written]))
        assert await first == [b"re:0"]
        for i, task in enumerate(rest, 1):
            assert await task == [b"re:%d.%d" % (i, j) for j in range(i % 3 + 1)]

    run(test)
