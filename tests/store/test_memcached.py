"""memcached: the sans-IO text protocol, both connections, and per-node health of a pool.

The protocol tests use no sockets. The rest run against real memcached servers (the
session fixtures, or private ones for tests that kill, restart or constrain a server),
through asynccache.testing.proxy.FaultProxy for latency, and against a scripted loopback server
for what a real memcached will not do on demand (close right after a request, send a
value nobody asked for).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asynccache as ac
from asynccache.store.api import NOT_READ
from asynccache.store.memcached.client import (
    MemcachedClient,
    rendezvous_owner,
    safe_memcached_key,
)
from asynccache.store.memcached.connection import MemcachedConnection, memcached_endpoint
from asynccache.store.memcached.consumer import BlockingMemcachedConnection
from asynccache.store.protocol.memcache import (
    DELETED,
    NOT_FOUND,
    STORED,
    VERSION,
    ErrorReply,
    ProtocolViolation,
    ReplyParser,
    Request,
    pack_delete,
    pack_get,
    pack_set,
)
from asynccache.testing import servers
from asynccache.testing.proxy import FaultProxy

# -- the text protocol, no sockets ----------------------------------------------------


def parse(requests: list[Request], stream: bytes, step: int = 0, max_value: int = 1 << 20
          ) -> list[object]:
    """Every reply of ``stream`` for ``requests``, fed whole (step 0) or ``step`` bytes
    at a time; asserts nothing is left over."""
    parser = ReplyParser(max_value)
    for request in requests:
        parser.expect(request)
    replies: list[object] = []
    pieces = [stream] if not step else [stream[i:i + step] for i in range(0, len(stream), step)]
    for piece in pieces:
        parser.feed(piece)
        while (reply := parser.next()) is not None:
            replies.append(reply)
    assert parser.waiting == 0 and parser.buffered == 0
    return replies


def test_requests_are_packed_as_buffers_without_copying_the_value() -> None:
    value = bytearray(b"x" * 1000)
    request = pack_set(b"k", value, 60, flags=3)
    assert request.buffers[0] == b"set k 3 60 1000\r\n"
    assert request.buffers[1] is value and request.buffers[2] == b"\r\n"
    assert pack_get([b"a", b"b"]).buffers == (b"get a b\r\n",)
    assert pack_get([b"a", b"b"]).keys == (b"a", b"b")
    assert pack_delete(b"a").buffers == (b"delete a\r\n",)
    assert VERSION.buffers == (b"version\r\n",)
    with pytest.raises(ValueError):
        pack_get([])


@pytest.mark.parametrize("step", [0, 1, 2, 7])
def test_pipelined_replies_split_at_any_byte(step: int) -> None:
    requests = [pack_get([b"a", b"b", b"c"]), pack_set(b"a", b"1", 0), pack_delete(b"a"),
                pack_delete(b"z"), VERSION, pack_get([b"q"]), pack_set(b"big", b"", 0)]
    stream = (b"VALUE a 0 2\r\nA!\r\nVALUE c 5 0\r\n\r\nEND\r\n"
              b"STORED\r\nDELETED\r\nNOT_FOUND\r\nVERSION 1.6.21\r\n"
              b"END\r\nSERVER_ERROR object too large for cache\r\n")
    assert parse(requests, stream, step) == [
        [b"A!", None, b""], STORED, DELETED, NOT_FOUND, b"VERSION 1.6.21", [None],
        ErrorReply(b"SERVER_ERROR", "object too large for cache")]


def test_values_may_contain_protocol_words_and_a_cas_field() -> None:
    tricky = b"END\r\nVALUE b 0 1\r\nx\r\n"
    stream = b"VALUE a 0 %d 99\r\n%s\r\nEND\r\n" % (len(tricky), tricky)
    assert parse([pack_get([b"a", b"b"])], stream, 1) == [[tricky, None]]


def test_out_of_order_hits_are_placed_by_key() -> None:
    stream = b"VALUE c 0 1\r\n3\r\nVALUE a 0 1\r\n1\r\nEND\r\n"
    assert parse([pack_get([b"a", b"b", b"c"])], stream) == [[b"1", None, b"3"]]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.binary(min_size=1, max_size=12).map(lambda b: b.hex().encode()),
                       st.one_of(st.none(), st.binary(max_size=300))),
             min_size=1, max_size=20, unique_by=lambda kv: kv[0]),
    st.integers(min_value=1, max_value=64),
)
def test_any_get_reply_split_anywhere_is_aligned_with_its_keys(
    items: list[tuple[bytes, bytes | None]], step: int
) -> None:
    keys = [k for k, _ in items]
    stream = b"".join(b"VALUE %s 0 %d\r\n%s\r\n" % (k, len(v), v) for k, v in items
                      if v is not None) + b"END\r\n"
    requests = [pack_get(keys), pack_set(keys[0], b"v", 0)]
    assert parse(requests, stream + b"STORED\r\n", step) == [[v for _, v in items], STORED]


def test_a_large_value_in_many_chunks() -> None:
    value = bytes(range(256)) * 4096  # 1 MiB
    stream = b"VALUE big 0 %d\r\n%s\r\nEND\r\n" % (len(value), value)
    assert parse([pack_get([b"big"])], stream, 65536, max_value=2 << 20) == [[value]]


def test_error_replies_are_values() -> None:
    requests = [pack_get([b"a"]), pack_set(b"a", b"1", 0), pack_delete(b"a")]
    stream = (b"SERVER_ERROR out of memory writing get response\r\n"
              b"CLIENT_ERROR bad data chunk\r\nERROR\r\n")
    first, second, third = parse(requests, stream, 3)
    assert first == ErrorReply(b"SERVER_ERROR", "out of memory writing get response")
    assert first.in_sync and not second.in_sync and not third.in_sync
    assert str(second) == "CLIENT_ERROR bad data chunk" and str(third) == "ERROR"


def test_a_value_over_the_bound_is_refused_before_its_bytes_arrive() -> None:
    parser = ReplyParser(max_value=1000)
    parser.expect(pack_get([b"a"]))
    parser.feed(b"VALUE a 0 4294967296\r\n")  # no 4 GB buffer: the header alone is refused
    with pytest.raises(ProtocolViolation, match="bound"):
        parser.next()


def test_an_endless_line_is_refused() -> None:
    parser = ReplyParser(max_value=1000)
    parser.expect(VERSION)
    parser.feed(b"VERSION " + b"9" * 10_000)
    with pytest.raises(ProtocolViolation, match="CRLF"):
        parser.next()


@pytest.mark.parametrize(("request_", "stream", "match"), [
    (pack_get([b"a"]), b"VALUE b 0 1\r\nx\r\nEND\r\n", "not asked"),
    (pack_get([b"a"]), b"VALUE a 0 1\r\nxy\r\nEND\r\n", "CRLF"),
    (pack_get([b"a"]), b"VALUE a zero\r\nEND\r\n", "malformed"),
    (pack_get([b"a"]), b"STORED\r\n", "unexpected line"),
    (pack_delete(b"a"), b"STORED\r\n", "unexpected reply"),
    (VERSION, b"END\r\n", "unexpected reply"),
])
def test_a_reply_that_does_not_fit_its_request_is_a_violation(
    request_: Request, stream: bytes, match: str
) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        parse([request_], stream)


def test_bytes_nobody_asked_for_are_a_violation() -> None:
    parser = ReplyParser(max_value=1000)
    parser.expect(VERSION)
    parser.feed(b"VERSION 1\r\nSTORED\r\n")
    assert parser.next() == b"VERSION 1"
    with pytest.raises(ProtocolViolation, match="no request"):
        parser.next()


# -- helpers -------------------------------------------------------------------------


def pool_url(pool: Sequence[servers.MemcachedServer | FaultProxy]) -> str:
    return "memcached://" + ",".join(f"{s.host}:{s.port}" for s in pool)


def owners(client: MemcachedClient, keys: Sequence[bytes]) -> list[str]:
    names = client.node_names
    return [names[rendezvous_owner(safe_memcached_key(k), names)] for k in keys]


def total_connections(server: servers.MemcachedServer) -> int:
    """memcached's own count of connections accepted so far (``stats``)."""
    with socket.create_connection((server.host, server.port), 5) as sock:
        sock.sendall(b"stats\r\n")
        reply = b""
        while not reply.endswith(b"END\r\n"):
            reply += sock.recv(65536)
    for line in reply.decode().splitlines():
        if line.startswith("STAT total_connections "):
            return int(line.split()[2])
    raise AssertionError("no total_connections in stats")


def blocking(server: servers.MemcachedServer | FaultProxy | ScriptedServer,
             timeout: float = 1.0) -> BlockingMemcachedConnection:
    return BlockingMemcachedConnection(
        memcached_endpoint(server.host, server.port, timeout=timeout, connect_timeout=1.0),
        max_value=2 << 20)


class ScriptedServer:
    """A loopback server whose n-th connection is handed to the n-th script; for what a
    real memcached will not do on demand (close right after a request, send a stray
    value)."""

    def __init__(self, scripts: list[Callable[[socket.socket], None]]) -> None:
        self.scripts = scripts
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self.listener.getsockname()[:2]
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        for script in self.scripts:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._run, args=(script, conn), daemon=True).start()

    @staticmethod
    def _run(script: Callable[[socket.socket], None], conn: socket.socket) -> None:
        with conn:
            script(conn)

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes a pending accept(); close() does not
        self.listener.close()
        self.thread.join(5)


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\r\n"):
        data += conn.recv(65536)
    return data


def close_after_request(conn: socket.socket) -> None:
    read_request(conn)


def answer(*replies: bytes) -> Callable[[socket.socket], None]:
    """Answer each request in turn with the next reply, then wait for the client to go."""
    def script(conn: socket.socket) -> None:
        for reply in replies:
            read_request(conn)
            conn.sendall(reply)
        conn.recv(1)
    return script


# -- the asyncio client: per-node health ---------------------------------------------


@pytest.mark.anyio
async def test_a_dead_node_costs_only_its_own_keys_and_comes_back(namespace: str) -> None:
    with servers.start_memcached() as live_server, servers.start_memcached() as dead_server:
        client = ac.connect(pool_url([live_server, dead_server]), timeout=0.5)
        assert isinstance(client, MemcachedClient)
        live, dead = client.node_names
        keys = [f"{namespace}:{i}".encode() for i in range(100)]
        owner = owners(client, keys)
        on_live = [k for k, o in zip(keys, owner) if o == live]
        assert 20 < len(on_live) < 80
        try:
            await client.set_many({k: b"old" + k for k in keys})
            dead_server.kill()

            result = await client.read(keys)
            assert list(result.failures) == [dead]
            assert isinstance(result.failures[dead], ac.StoreUnavailable)
            assert result.answered == [live] and result.skipped == 0
            assert result.values == [b"old" + k if o == live else NOT_READ
                                     for k, o in zip(keys, owner)]

            written = await client.write({k: b"new" + k for k in keys})
            assert written.written == len(on_live) and written.answered == [live]
            assert list(written.failures) == [dead]
            assert written.failed_keys == len(keys) - len(on_live) and not written.rejected
            with pytest.raises(ac.StoreUnavailable):  # the all-or-nothing level raises
                await client.get_many(keys)

            dead_server.restart()  # same port, empty
            result = await client.read(keys)
            assert not result.failures and sorted(result.answered) == sorted([live, dead])
            assert result.values == [b"new" + k if o == live else None
                                     for k, o in zip(keys, owner)]
            await client.set_many({k: b"again" for k in keys})
            assert await client.get_many(keys) == [b"again"] * len(keys)
        finally:
            await client.close()


@pytest.mark.anyio
async def test_a_slow_node_times_out_alone_and_nodes_are_asked_concurrently(
    memcached_pool: list[servers.MemcachedServer], namespace: str
) -> None:
    fast, slow_server = memcached_pool
    with FaultProxy(slow_server.host, slow_server.port) as slow:
        client = ac.connect(pool_url([fast, slow]), timeout=0.4)
        keys = [f"{namespace}:{i}".encode() for i in range(60)]
        owner = owners(client, keys)
        fast_name, slow_name = client.node_names
        try:
            await client.set_many({k: k for k in keys})
            slow.set_latency(2.0)
            started = time.perf_counter()
            result = await client.read(keys)
            elapsed = time.perf_counter() - started
            assert 0.35 < elapsed < 1.8  # one timeout, not 2 s; the fast node did not wait
            assert list(result.failures) == [slow_name]
            assert isinstance(result.failures[slow_name], ac.StoreTimeout)
            assert result.values == [k if o == fast_name else NOT_READ
                                     for k, o in zip(keys, owner)]
        finally:
            slow.set_latency(0)
            await client.close()


@pytest.mark.anyio
async def test_nodes_in_skip_are_not_contacted(memcached_pool: list[servers.MemcachedServer],
                                               namespace: str) -> None:
    up, behind = memcached_pool
    with FaultProxy(behind.host, behind.port) as proxy:
        client = ac.connect(pool_url([up, proxy]), timeout=2.0)
        keys = [f"{namespace}:{i}".encode() for i in range(60)]
        owner = owners(client, keys)
        up_name, skipped_name = client.node_names
        n_skipped = owner.count(skipped_name)
        try:
            await client.set_many({k: k for k in keys})
            proxy.set_blackhole(True)  # contacting it would cost the 2 s timeout
            started = time.perf_counter()
            result = await client.read(keys, skip={skipped_name})
            written = await client.write({k: b"w" for k in keys}, skip={skipped_name})
            assert time.perf_counter() - started < 1.8  # contacting it: the 2 s timeout
            assert not result.failures and result.answered == [up_name]
            assert result.skipped == n_skipped
            assert result.values == [k if o == up_name else NOT_READ
                                     for k, o in zip(keys, owner)]
            assert written.skipped == n_skipped and written.written == len(keys) - n_skipped
            assert not written.failures
        finally:
            proxy.set_blackhole(False)
            await client.close()


# -- per-key rejections ----------------------------------------------------------------


@pytest.fixture(scope="module")
def small_items() -> Iterator[servers.MemcachedServer]:
    """memcached with ``-I 512k``: the smallest item size memcached 1.6 starts with at its
    default slab_chunk_max (lowering that too makes 1.6.18 crash on the first set)."""
    with servers.start_memcached(item_size="512k") as server:
        yield server


@pytest.mark.anyio
async def test_a_value_over_the_item_size_is_rejected_alone(
    small_items: servers.MemcachedServer, namespace: str
) -> None:
    client = ac.connect(small_items.url)  # item_size left at 1m: the client sends it
    small, big, other = (f"{namespace}:{n}".encode() for n in ("small", "big", "other"))
    try:
        result = await client.write({small: b"s", big: b"x" * (600 * 1024), other: b"o"})
        assert result.written == 2 and not result.failures
        assert list(result.rejected) == [big]
        error = result.rejected[big]
        assert isinstance(error, ac.StoreRejected)
        assert "-I" in str(error) and "item_size=" in str(error)
        assert await client.get_many([small, big, other]) == [b"s", None, b"o"]
        with pytest.raises(ac.StoreRejected, match="too large"):
            await client.set_many({big: b"x" * (600 * 1024)})
    finally:
        await client.close()


@pytest.mark.anyio
async def test_a_full_server_without_eviction_rejects_per_key(namespace: str) -> None:
    with servers.start_memcached(memory_mb=2, extra_args=["-M"]) as server:
        client = ac.connect(server.url)
        entries = {f"{namespace}:{i}".encode(): b"v" * (100 * 1024) for i in range(60)}
        try:
            result = await client.write(entries)
            assert not result.failures and result.answered == list(client.node_names)
            assert result.written > 0 and result.rejected
            assert result.written + len(result.rejected) == len(entries)
            message = str(next(iter(result.rejected.values())))
            assert "out of memory" in message and "-M" in message and "-m" in message
            await client.ping()  # the connection is still in sync
        finally:
            await client.close()


# -- connections: idle close, late replies, deadlines -----------------------------------


@pytest.fixture(scope="module")
def idle_closing() -> Iterator[servers.MemcachedServer]:
    with servers.start_memcached(extra_args=["-o", "idle_timeout=1"]) as server:
        yield server


@pytest.mark.anyio
async def test_asyncio_read_after_the_server_closed_the_idle_connection(
    idle_closing: servers.MemcachedServer, namespace: str
) -> None:
    client = ac.connect(idle_closing.url, timeout=0.5)
    key = f"{namespace}:k".encode()
    try:
        await client.set_many({key: b"v"})
        assert await client.get_many([key]) == [b"v"]
        before = total_connections(idle_closing)
        await asyncio.sleep(2.5)
        assert await client.get_many([key]) == [b"v"]
        assert total_connections(idle_closing) > before  # it was closed: a new one was made
    finally:
        await client.close()


def test_blocking_read_after_the_server_closed_the_idle_connection(
    idle_closing: servers.MemcachedServer,
) -> None:
    conn = blocking(idle_closing)
    try:
        conn.send_get([b"nothing-here"])
        assert conn.receive() == [None]
        before = total_connections(idle_closing)
        time.sleep(2.5)
        conn.send_get([b"nothing-here", b"nor-here"])
        assert conn.receive() == [None, None]
        assert total_connections(idle_closing) > before
    finally:
        conn.close()


@pytest.mark.anyio
async def test_asyncio_request_retried_once_when_a_fresh_connection_closes() -> None:
    with ScriptedServer([close_after_request,
                         answer(b"VERSION 1\r\n", b"END\r\n")]) as server:
        conn = MemcachedConnection(memcached_endpoint(server.host, server.port),
                                   max_value=1024)
        try:
            assert await conn.execute([VERSION]) == [b"VERSION 1"]  # retried, no error
            assert await conn.execute([pack_get([b"k"])]) == [[None]]
        finally:
            conn.close()


def test_blocking_request_retried_once_after_idle_but_not_mid_stream() -> None:
    def answer_a_then_b_then_close(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"END\r\n")  # "get a", sent again
        data = b""
        while data.count(b"\r\n") < 2:  # "get b" and "get c"
            data += conn.recv(65536)
        conn.sendall(b"END\r\n")  # b's reply only, then the connection closes

    with ScriptedServer([close_after_request, answer_a_then_b_then_close]) as server:
        conn = blocking(server)
        try:
            conn.send_get([b"a"])
            assert conn.receive() == [None]  # first connection closed: resent once
            conn.send_get([b"b"])
            conn.send_get([b"c"])
            assert conn.receive() == [None]
            with pytest.raises(ac.StoreUnavailable):
                conn.receive()
            assert conn.sock is None and not conn.pending
        finally:
            conn.close()


@pytest.mark.anyio
async def test_a_value_nobody_asked_for_fails_the_connection() -> None:
    stray = b"VALUE other 0 1\r\nx\r\nEND\r\n"
    with ScriptedServer([answer(stray), answer(stray)]) as server:
        conn = MemcachedConnection(memcached_endpoint(server.host, server.port),
                                   max_value=1024)
        with pytest.raises(ac.StoreError, match="not asked for"):
            await conn.execute([pack_get([b"mine"])])
        conn.close()
        reader = blocking(server)
        reader.send_get([b"mine"])
        with pytest.raises(ac.StoreError, match="not asked for"):
            reader.receive()
        assert reader.sock is None
        reader.close()


def test_blocking_deadline_is_end_to_end_and_the_connection_recovers(
    memcached_server: servers.MemcachedServer,
) -> None:
    with FaultProxy(memcached_server.host, memcached_server.port) as proxy:
        conn = blocking(proxy, timeout=0.3)
        try:
            conn.send_get([b"warm"])
            assert conn.receive() == [None]
            proxy.set_latency(2.0)
            conn.send_get([b"slow"])
            started = time.perf_counter()
            with pytest.raises(ac.StoreTimeout, match="timeout="):
                conn.receive()
            assert 0.2 < time.perf_counter() - started < 1.8  # one 0.3 s timeout, not 2 s
            assert conn.sock is None and not conn.pending
            conn.send_get([b"slow"])
            time.sleep(0.35)
            with pytest.raises(ac.StoreTimeout):  # poll() enforces the deadline too
                conn.poll()
            proxy.set_latency(0)
            conn.send_get([b"fast"])
            assert conn.receive() == [None]
        finally:
            proxy.set_latency(0)
            conn.close()


# -- consumer-side reads -----------------------------------------------------------------


def test_pipe_on_a_pool_keeps_serving_when_one_node_dies(namespace: str) -> None:
    source = [{"i": i} for i in range(200)]
    with servers.start_memcached() as a, servers.start_memcached() as b:
        url = pool_url([a, b])
        with ac.AsyncKVCacheMapDataPipe(source, ac.connect(url, timeout=0.3), prefetch=16,
                                        namespace=namespace) as warm:
            warm.__getitems__(list(range(200)))
        b.kill()
        with ac.AsyncKVCacheMapDataPipe(source, ac.connect(url, timeout=0.3), prefetch=16,
                                        namespace=namespace) as dp:
            started = time.perf_counter()
            assert [dp[i] for i in range(200)] == source
            assert time.perf_counter() - started < 10.0  # a timeout per dead item: 30 s
            stats = dp.stats()
    assert stats["hits"] > 40  # the live node's share was read, not recomputed
    assert stats["unavailable"] >= 1 and stats["errors"] <= 5


@pytest.mark.parametrize("years", [1, 20])
def test_a_ttl_reaching_past_2038_keeps_the_value(memcached_server: servers.MemcachedServer,
                                                  namespace: str, years: int) -> None:
    """memcached reads an exptime over 30 days as a signed 32-bit Unix time: 20 years from
    now was a time in the past, the value stored already expired (every read a miss, no
    error). A ttl past 2038 now means no expiry; one before it stays an absolute time."""
    ttl = years * 365 * 24 * 3600.0

    async def run() -> tuple[object, dict[str, int]]:
        async with ac.AsyncKVCache(ac.connect(memcached_server.url), namespace=namespace,
                                   ttl=ttl, on_error="raise") as cache:
            await cache.set("k", {"kept": years})
            return await cache.get("k", default=None), cache.stats()

    value, stats = asyncio.run(run())
    assert value == {"kept": years} and stats["errors"] == 0
