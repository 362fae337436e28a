"""asynccache.testing.proxy.FaultProxy between real clients and a real redis-server/memcached."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asynccache.testing.proxy import FaultProxy, url_through
from asynccache.testing.servers import RedisServer, start_memcached, start_redis

RTT = 0.02


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with start_redis() as srv:
        yield srv


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[FaultProxy]:
    assert server.port is not None
    with FaultProxy("127.0.0.1", server.port) as prx:
        yield prx


def client(proxy: FaultProxy, **kwargs: float) -> redis.Redis:
    """No retries: a fault must surface on the first command, not be papered over."""
    kwargs.setdefault("socket_timeout", 5)
    return redis.Redis(port=proxy.port, retry=Retry(NoBackoff(), 0), **kwargs)  # type: ignore[arg-type]


def raw_ping(port: int, timeout: float = 5) -> socket.socket:
    """A connection that has done one PING (closed again if that fails)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        sock.sendall(b"PING\r\n")
        assert sock.recv(100) == b"+PONG\r\n"
    except BaseException:
        sock.close()
        raise
    return sock


def wait_for(predicate: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_forwards_bytes_in_order(proxy: FaultProxy, server: RedisServer) -> None:
    big = bytes(range(256)) * 12_000  # ~3 MB: many chunks each way
    with redis.Redis.from_url(url_through(proxy, server.url)) as r:
        assert r.set("big", big) and r.get("big") == big
        assert proxy.connections == 1
        proxy.set_latency(0.01)  # order must survive queueing too
        values = {f"k{i}": bytes([i % 251]) * (i * 997) for i in range(60)}
        r.mset(values)
        pipe = r.pipeline(transaction=False)
        for key in values:
            pipe.get(key)
        assert pipe.execute() == list(values.values())
    stats = proxy.stats
    assert stats["accepted"] == 1 and stats["reset"] == 0
    assert stats["bytes_up"] > len(big) and stats["bytes_down"] > len(big)
    wait_for(lambda: proxy.connections == 0)


def test_latency_per_round_trip_and_pipelining_overlaps(proxy: FaultProxy) -> None:
    with client(proxy) as r:
        r.ping()  # connect outside the measurement
        proxy.set_latency(RTT)
        start = time.perf_counter()
        r.ping()
        assert time.perf_counter() - start >= RTT
        start = time.perf_counter()
        for _ in range(5):
            r.ping()
        assert time.perf_counter() - start >= 5 * RTT
        pipe = r.pipeline(transaction=False)
        for i in range(50):
            pipe.set(f"p{i}", i)
        start = time.perf_counter()
        pipe.execute()
        assert time.perf_counter() - start < 25 * RTT  # one after another: 50 * RTT
        proxy.set_latency(0)
        fastest = float("inf")
        for _ in range(5):  # the best of a few: one ping can be slow on a busy box
            start = time.perf_counter()
            r.ping()
            fastest = min(fastest, time.perf_counter() - start)
        assert fastest < RTT


def test_chunks_arriving_apart_overlap(proxy: FaultProxy) -> None:
    """Requests sent as separate TCP segments are delayed together, not one after another."""
    rtt, n = 0.05, 20
    proxy.set_latency(rtt)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        for _ in range(n):
            sock.sendall(b"PING\r\n")
            time.sleep(0.002)
        reply = b""
        while len(reply) < n * 7:
            reply += sock.recv(4096)
        elapsed = time.perf_counter() - start
    assert reply == b"+PONG\r\n" * n
    assert rtt <= elapsed < n * rtt / 2.5  # serialised per chunk would take >= n * rtt / 2


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed early"
        data += chunk
    return data


def test_trickle_paces_a_large_reply(proxy: FaultProxy) -> None:
    """64 KiB per 0.25 s: a 256 KiB GET takes >= 0.75 s, yet no read waits for 1 s."""
    value = os.urandom(256 * 1024)
    with client(proxy, socket_timeout=1) as r:
        assert r.set("trickled", value)
        proxy.set_trickle(64 * 1024, 0.25)
        assert "trickle=65536B/0.25s down" in repr(proxy)
        start = time.perf_counter()
        assert r.get("trickled") == value
        assert 0.7 <= time.perf_counter() - start < 3
        proxy.set_trickle(0, 0)
        assert "trickle=off" in repr(proxy)
        fastest = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            assert r.get("trickled") == value
            fastest = min(fastest, time.perf_counter() - start)
        assert fastest < 0.2


def test_trickle_splits_and_lifting_it_wakes_the_writer(
    proxy: FaultProxy, server: RedisServer
) -> None:
    value = bytes(range(256)) * 1024
    reply = b"$%d\r\n%s\r\n" % (len(value), value)
    server.call("SET", "pieces", value)
    proxy.set_trickle(64 * 1024, 30)  # the next piece would come long after the test
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET pieces\r\n")
        got = recv_exactly(sock, 64 * 1024)  # the first piece at once ...
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # ... and not a byte more
        sock.settimeout(5)
        start = time.perf_counter()
        proxy.set_trickle(None)  # ends the 30 s pause
        got += recv_exactly(sock, len(reply) - len(got))
        assert time.perf_counter() - start < 10  # not the rest of the 30 s pause
    assert got == reply
    proxy.stop()  # a restarted proxy (new loop) can pause again
    proxy.start()
    proxy.set_trickle(64 * 1024, 0.05)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        start = time.perf_counter()
        sock.sendall(b"GET pieces\r\n")
        assert recv_exactly(sock, len(reply)) == reply
        assert time.perf_counter() - start >= 0.15  # 5 pieces, 4 pauses


def test_trickle_budget_is_per_window_not_per_read() -> None:
    """A reply the server writes in two parts still gets the window's whole budget at once.

    This was a CI flake: a 256 KiB reply read by the proxy as 20 KiB and then the rest used
    up the window on the short first piece, and the client waited the full period.
    """
    first, rest = b"a" * 20_000, b"b" * 200_000
    listener = socket.create_server(("127.0.0.1", 0))

    def upstream() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(100)
            conn.sendall(first)
            time.sleep(0.1)  # the proxy has forwarded `first` as a piece of its own by now
            conn.sendall(rest)
            conn.recv(100)  # until the client closes

    thread = threading.Thread(target=upstream, daemon=True)
    thread.start()
    with listener, FaultProxy("127.0.0.1", listener.getsockname()[1]) as prx:
        prx.set_trickle(64 * 1024, 30)
        with socket.create_connection(("127.0.0.1", prx.port), timeout=5) as sock:
            sock.sendall(b"GO\r\n")
            got = recv_exactly(sock, 64 * 1024)  # a whole window's budget, in two parts
            assert got == first + rest[: 64 * 1024 - len(first)]  # both writes in it
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(1)  # ... and not a byte more within the window
    thread.join(5)


def test_trickle_up_and_both_compose_with_latency_in_order(proxy: FaultProxy) -> None:
    values = {f"t{i}": os.urandom(10_000 + i) for i in range(8)}  # ~80 KB: >= 5 pieces up
    with client(proxy) as r:
        r.ping()
        proxy.set_latency(RTT)
        proxy.set_trickle(16 * 1024, 0.05, "up")
        start = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for key, value in values.items():
            pipe.set(key, value)
        for key in values:
            pipe.get(key)
        assert pipe.execute()[len(values) :] == list(values.values())
        assert time.perf_counter() - start >= 4 * 0.05 + RTT
        proxy.set_trickle(7, 0.001, "both")  # ~100 tiny pieces each way, still in order
        assert r.getrange("t5", 0, 699) == values["t5"][:700]
    with pytest.raises(ValueError, match="direction"):
        proxy.set_trickle(1, 1, "sideways")
    for nbytes, every in ((-1, 1), (1, 0), (1, -1)):
        with pytest.raises(ValueError, match="every"):
            proxy.set_trickle(nbytes, every)


def test_blackhole_then_recovery(proxy: FaultProxy) -> None:
    with client(proxy, socket_timeout=0.3) as r:
        assert r.ping()
        proxy.set_blackhole(True)
        before = proxy.stats
        start = time.perf_counter()
        with pytest.raises(redis.TimeoutError):
            r.ping()
        assert time.perf_counter() - start >= 0.3
        with client(proxy, socket_timeout=0.3) as fresh, pytest.raises(redis.TimeoutError):
            fresh.ping()  # new connections are accepted, and hang too
        after = proxy.stats
        assert after["bytes_up"] == before["bytes_up"]
        assert after["bytes_down"] == before["bytes_down"]
        assert after["accepted"] == before["accepted"] + 1
        proxy.set_blackhole(False)
    with client(proxy, socket_timeout=0.3) as r:
        assert r.ping()


def test_reset_all(proxy: FaultProxy) -> None:
    conn = redis.Connection(port=proxy.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    raw = raw_ping(proxy.port)
    try:
        conn.connect()
        conn.send_command("PING")
        assert conn.read_response() in (b"PONG", "PONG", True)
        wait_for(lambda: proxy.connections == 2)
        proxy.reset_all()
        assert proxy.connections == 0
        assert proxy.stats["reset"] == 2
        with pytest.raises(redis.ConnectionError):
            conn.send_command("PING")
            conn.read_response()
        with pytest.raises(ConnectionResetError):
            raw.recv(100)
    finally:
        conn.disconnect()
        raw.close()
    raw_ping(proxy.port).close()  # new connections are fine


def test_refuse_resets_new_connections_only(proxy: FaultProxy) -> None:
    with raw_ping(proxy.port) as existing:
        proxy.set_refuse(True)
        with pytest.raises(ConnectionResetError):  # at connect(), send() or recv()
            raw_ping(proxy.port).close()
        with client(proxy) as r, pytest.raises(redis.ConnectionError):
            r.ping()
        existing.sendall(b"PING\r\n")
        assert existing.recv(100) == b"+PONG\r\n"
        assert proxy.stats["reset"] >= 2
        proxy.set_refuse(False)
        raw_ping(proxy.port).close()


def test_dead_upstream_resets_the_client() -> None:
    with start_redis() as srv, FaultProxy("127.0.0.1", srv.port or 0) as prx:
        srv.kill()
        with client(prx) as r, pytest.raises(redis.ConnectionError):
            r.ping()
        srv.restart()
        with client(prx) as r:
            assert r.ping()


def test_memcached_through_proxy_with_latency() -> None:
    with start_memcached() as mc, FaultProxy("127.0.0.1", mc.port or 0) as prx:
        assert url_through(prx, mc.url) == f"memcached://127.0.0.1:{prx.port}"
        prx.set_latency(RTT)
        with socket.create_connection(("127.0.0.1", prx.port), timeout=5) as sock:
            start = time.perf_counter()
            sock.sendall(b"set k 0 0 2\r\nhi\r\nget k\r\n")
            reply = b""
            while not reply.endswith(b"END\r\n"):
                reply += sock.recv(4096)
            assert RTT <= time.perf_counter() - start < 5 * RTT
        assert reply == b"STORED\r\nVALUE k 0 2\r\nhi\r\nEND\r\n"


def test_usable_from_async_code(proxy: FaultProxy) -> None:
    """Its own loop thread: an asyncio caller's loop is never blocked, connections overlap."""
    rtt, n = 0.05, 20
    proxy.set_latency(rtt)

    async def ping() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(b"PING\r\n")
            return await reader.readline()
        finally:
            writer.close()
            await writer.wait_closed()

    async def main() -> list[bytes]:
        return await asyncio.gather(*(ping() for _ in range(n)))

    start = time.perf_counter()
    assert asyncio.run(main()) == [b"+PONG\r\n"] * n
    assert rtt <= time.perf_counter() - start < n * rtt / 2  # one after another: >= n * rtt


def test_stop_is_idempotent_and_start_reuses_the_port(proxy: FaultProxy) -> None:
    sock = raw_ping(proxy.port)
    try:
        port = proxy.port
        proxy.stop()
        assert sock.recv(100) == b""  # closed
        proxy.stop()
        assert not any(t.name.startswith("FaultProxy") for t in threading.enumerate())
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        proxy.start()
        assert proxy.port == port
        raw_ping(port).close()
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("target", "listen"),
    [("10.0.0.1", "127.0.0.1"), ("example.com", "127.0.0.1"), ("127.0.0.1", "0.0.0.0")],
)
def test_only_loopback(target: str, listen: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy(target, 6379, listen_host=listen)


def test_url_through(proxy: FaultProxy) -> None:
    p = proxy.port
    assert url_through(proxy, "redis://:pw@127.0.0.1:6379/3") == f"redis://:pw@127.0.0.1:{p}/3"
    assert url_through(proxy, "memcached://127.0.0.1:11211") == f"memcached://127.0.0.1:{p}"
    for url in ("redis+cluster://127.0.0.1:1,127.0.0.1:2", "unix:///tmp/redis.sock"):
        with pytest.raises(ValueError):
            url_through(proxy, url)
    with pytest.raises(ValueError, match="start"):
        url_through(FaultProxy("127.0.0.1", 6379), "redis://127.0.0.1:6379/0")
