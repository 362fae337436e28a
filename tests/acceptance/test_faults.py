"""Store failures become counted misses: black holes, resets, dead servers, late replies.

Faults are injected with asynccache.testing.proxy.FaultProxy (loopback only) and by killing
real server processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest

import asynccache as ac
from asynccache.testing import servers
from asynccache.testing.proxy import FaultProxy, url_through

pytestmark = pytest.mark.anyio

SINGLE_HOST = ["redis", "memcached"]


@pytest.fixture(params=SINGLE_HOST)
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, str]]:
    server = request.getfixturevalue(f"{request.param}_server")
    with FaultProxy(server.host, server.port) as proxy:
        yield proxy, url_through(proxy, server.url)


async def test_black_hole_times_out_into_misses_logged_once(
    proxied: tuple[FaultProxy, str], namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy, url = proxied
    client = ac.connect(url, timeout=0.3)
    cache = ac.AsyncKVCache(client, namespace=namespace)
    await cache.set_many({i: i for i in range(10)})
    proxy.set_blackhole(True)
    with caplog.at_level(logging.WARNING, logger="asynccache"):
        started = time.perf_counter()
        assert await cache.get_many(range(10)) == {}
        assert time.perf_counter() - started < 10.0  # a black hole: forever without a deadline
        # the store is now skipped for a back-off period: no second timeout per call
        started = time.perf_counter()
        for _ in range(20):
            assert await cache.get(1, default="miss") == "miss"
        assert time.perf_counter() - started < 3.0  # a timeout each would be 6 s
    stats = cache.stats()
    assert stats["timeouts"] == 1 and stats["errors"] == 1 and stats["skipped"] == 20
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "timeout" in warnings[0].getMessage().lower()
    proxy.set_blackhole(False)
    proxy.reset_all()
    await asyncio.sleep(0.6)  # first back-off is 0.5 s
    assert await cache.get_many(range(10)) == {i: i for i in range(10)}
    await client.close()


async def test_raise_mode_raises_store_timeout(proxied: tuple[FaultProxy, str],
                                               namespace: str) -> None:
    proxy, url = proxied
    client = ac.connect(url, timeout=0.2)
    cache = ac.AsyncKVCache(client, namespace=namespace, on_error="raise")
    proxy.set_blackhole(True)
    with pytest.raises(ac.StoreTimeout, match="timeout="):
        await cache.get("k")
    with pytest.raises(ac.StoreTimeout):  # raise mode has no back-off: it tries every time
        await cache.set("k", 1)
    proxy.set_blackhole(False)
    proxy.reset_all()
    await client.close()


async def test_late_reply_is_never_read_as_the_next_answer(
    proxied: tuple[FaultProxy, str], namespace: str
) -> None:
    """A timed-out request's reply arrives later; the next request must not consume it.

    Every request owns its slot in the connection's reply queue, and a connection that
    timed out is closed: a late reply can never answer another request.
    """
    proxy, url = proxied
    client = ac.connect(url, timeout=0.15)
    cache = ac.AsyncKVCache(client, namespace=namespace, on_error="raise")
    await cache.set_many({"a": "value of a", "b": "value of b"})
    proxy.set_latency(0.4)
    with pytest.raises(ac.StoreTimeout):
        await cache.get("a")
    proxy.set_latency(0)
    await asyncio.sleep(0.5)  # the late reply for "a" has arrived by now
    assert await cache.get("b") == "value of b"
    assert await cache.get_many(["a", "b"]) == {"a": "value of a", "b": "value of b"}
    await client.close()


async def test_connection_reset_recovers(proxied: tuple[FaultProxy, str], namespace: str) -> None:
    proxy, url = proxied
    client = ac.connect(url, timeout=0.5)
    cache = ac.AsyncKVCache(client, namespace=namespace)
    await cache.set_many({i: str(i) for i in range(50)})
    proxy.reset_all()
    first = await cache.get_many(range(50))  # a reset connection: a miss or a retry, never wrong
    assert all(first[k] == str(k) for k in first)
    await asyncio.sleep(0.6)
    assert await cache.get_many(range(50)) == {i: str(i) for i in range(50)}
    await client.close()


async def test_refused_connections_fall_back(proxied: tuple[FaultProxy, str],
                                             namespace: str) -> None:
    proxy, url = proxied
    proxy.set_refuse(True)
    client = ac.connect(url, timeout=0.5)
    cache = ac.AsyncKVCache(client, namespace=namespace)
    assert await cache.get_or_compute("k", lambda: "computed") == "computed"
    assert cache.stats()["unavailable"] >= 1
    await client.close()


@pytest.mark.parametrize("kind", ["redis", "memcached"])
async def test_killed_server_then_restart(kind: str, namespace: str) -> None:
    server = servers.start_redis() if kind == "redis" else servers.start_memcached()
    with server:
        client = ac.connect(server.url, timeout=0.3)
        cache = ac.AsyncKVCache(client, namespace=namespace)
        await cache.set_many({i: i for i in range(20)})
        server.kill()
        assert await cache.get_many(range(20)) == {}
        await cache.set("after", 1)  # dropped, counted, no exception
        stats = cache.stats()
        assert stats["errors"] >= 1 and stats["writes_dropped"] >= 1
        server.restart()  # empty: persistence is off
        await asyncio.sleep(0.6)
        await cache.set("after", 2)
        assert await cache.get_many(["after", 1]) == {"after": 2}
        await client.close()


def _pipe_source(n: int) -> list[dict[str, int]]:
    return [{"i": i} for i in range(n)]


def test_pipe_read_ahead_falls_back_and_recovers(proxied: tuple[FaultProxy, str],
                                                 namespace: str) -> None:
    """Read-ahead (consumer-side socket for Redis, loop thread for memcached) turns a
    black-holed store into computed values, quickly, and uses the store again after."""
    proxy, url = proxied
    source = _pipe_source(300)
    with ac.AsyncKVCacheMapDataPipe(source, ac.connect(url, timeout=0.3), prefetch=32,
                                    namespace=namespace) as warm:
        warm.__getitems__(list(range(300)))
    dp = ac.AsyncKVCacheMapDataPipe(source, ac.connect(url, timeout=0.3), prefetch=32,
                                    namespace=namespace)
    try:
        assert [dp[i] for i in range(100)] == source[:100]
        assert dp.stats()["hits"] >= 100
        proxy.set_blackhole(True)
        started = time.perf_counter()
        assert [dp[i] for i in range(100, 200)] == source[100:200]
        # one timeout, then back-off: a timeout per item would be 30 s
        assert time.perf_counter() - started < 10.0
        stats = dp.stats()
        assert stats["timeouts"] >= 1 and stats["errors"] <= 3
        proxy.set_blackhole(False)
        proxy.reset_all()
        time.sleep(0.6)
        before = dp.stats()["hits"]
        assert [dp[i] for i in range(200, 300)] == source[200:300]
        assert dp.stats()["hits"] - before >= 90
    finally:
        dp.close()


def test_pipe_raise_mode_raises(proxied: tuple[FaultProxy, str], namespace: str) -> None:
    proxy, url = proxied
    dp = ac.AsyncKVCacheMapDataPipe(_pipe_source(50), ac.connect(url, timeout=0.2),
                                    prefetch=8, namespace=namespace, on_error="raise")
    try:
        assert dp[0] == {"i": 0}
        proxy.set_blackhole(True)
        with pytest.raises(ac.StoreTimeout):
            for i in range(1, 50):
                dp[i]
    finally:
        proxy.set_blackhole(False)
        proxy.reset_all()
        dp.close()
