"""Large values on the consumer's own socket: the parser switch, faults, damaged values.

Values of 64 KiB and more are read by :class:`~asynccache.store.protocol.resp_bulk.BulkReader`
(each into its own buffer), smaller ones by hiredis; the connection changes parser at a
reply boundary when the sizes it sees cross the threshold. Every test reads through the
pipe from a real Redis, behind the loopback fault proxy where a fault is injected, and
checks the promise: every value right, no exception in fallback mode.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

import asynccache as ac
from asynccache.store.redis.consumer import BlockingRespConnection
from asynccache.testing import servers
from asynccache.testing.proxy import FaultProxy, url_through

BIG = 96 << 10


def _values(n: int, size: int, salt: int = 0) -> list[bytes]:
    return [(b"%06d:" % (i + salt)) * (size // 7) for i in range(n)]


class Computed:
    """A source that counts what the pipe had to compute (a miss, a fallback)."""

    def __init__(self, values: list[bytes]) -> None:
        self.values = values
        self.calls = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> bytes:
        with self.lock:
            self.calls += 1
        return self.values[i]


@pytest.fixture
def switches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every parser switch of a consumer connection: True for a switch to large values."""
    seen: list[bool] = []
    original = BlockingRespConnection._switch_parser

    def spy(self: BlockingRespConnection) -> None:
        original(self)
        seen.append(self.big)

    monkeypatch.setattr(BlockingRespConnection, "_switch_parser", spy)
    return seen


@pytest.fixture
def proxied_redis(redis_server: servers.RedisServer) -> Iterator[tuple[FaultProxy, str]]:
    with FaultProxy(redis_server.host, redis_server.port) as proxy:
        yield proxy, url_through(proxy, redis_server.url)


def _warm(pipe: ac.AsyncKVCacheMapDataPipe, n: int) -> None:
    for i in range(n):
        pipe[i]
    pipe.flush()


def test_large_values_are_read_right_after_the_parser_switch(
    redis_server: servers.RedisServer, namespace: str, switches: list[bool]
) -> None:
    values = _values(60, BIG)
    source = Computed(values)
    pipe = ac.AsyncKVCacheMapDataPipe(source, ac.connect(redis_server.url), prefetch=64,
                                      namespace=namespace)
    try:
        _warm(pipe, len(values))
        source.calls = 0
        for _ in range(2):
            assert [pipe[i] for i in range(len(values))] == values
        assert source.calls == 0  # all read from the store
        assert True in switches  # ... by the BulkReader
    finally:
        pipe.close()


def test_sizes_that_change_switch_the_parser_back_and_forth(
    redis_server: servers.RedisServer, namespace: str, switches: list[bool]
) -> None:
    """Runs of small and large values, read in order and out of order: the switches
    happen between replies, and no reply is split between two parsers."""
    values: list[bytes] = []
    for run in range(6):
        values += _values(80 if run % 2 == 0 else 40, 120 if run % 2 == 0 else BIG,
                          salt=run * 1000)
    source = Computed(values)
    pipe = ac.AsyncKVCacheMapDataPipe(source, ac.connect(redis_server.url), prefetch=32,
                                      namespace=namespace)
    try:
        _warm(pipe, len(values))
        source.calls = 0
        assert [pipe[i] for i in range(len(values))] == values
        order = list(range(len(values)))[::-1]
        pipe.set_order(order)
        assert [pipe[i] for i in order] == [values[i] for i in order]
        assert source.calls == 0
        assert True in switches and False in switches
    finally:
        pipe.close()


@pytest.mark.parametrize("fault", ["reset", "trickle", "black hole"])
def test_faults_while_reading_large_values_fall_back_to_right_values(
    proxied_redis: tuple[FaultProxy, str], namespace: str, fault: str
) -> None:
    proxy, url = proxied_redis
    values = _values(48, BIG)
    source = Computed(values)
    pipe = ac.AsyncKVCacheMapDataPipe(source, ac.connect(url, timeout=0.3), prefetch=64,
                                      namespace=namespace)
    try:
        _warm(pipe, len(values))
        assert [pipe[i] for i in range(8)] == values[:8]  # large-value parser in use
        if fault == "reset":
            proxy.reset_all()
        elif fault == "trickle":
            proxy.set_trickle(512, every=0.05)
        else:
            proxy.set_blackhole(True)
        started = time.monotonic()
        assert [pipe[i] for i in range(8, len(values))] == values[8:]
        assert time.monotonic() - started < 10
        proxy.set_trickle(None)
        proxy.set_blackhole(False)
        proxy.reset_all()
        time.sleep(1.2)  # past the back-off
        source.calls = 0
        assert [pipe[i] for i in range(len(values))] == values
        assert source.calls <= 4  # recovered: the store serves the scan again
    finally:
        pipe.close()


def test_damaged_large_values_are_misses_never_wrong(
    redis_server: servers.RedisServer, namespace: str
) -> None:
    values = _values(30, BIG)
    source = Computed(values)
    pipe = ac.AsyncKVCacheMapDataPipe(source, ac.connect(redis_server.url), prefetch=64,
                                      namespace=namespace)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        _warm(pipe, len(values))
        keys = [pipe.key_for(i) for i in range(len(values))]
        good = raw.mget(keys)
        for i, (key, blob) in enumerate(zip(keys, good)):
            assert blob is not None
            if i % 3 == 0:
                raw.set(key, b"\x00junk" * (BIG // 5))  # large junk
            elif i % 3 == 1:
                raw.set(key, blob[: len(blob) - 1])  # one byte short
            else:
                raw.set(key, good[(i + 3) % len(values)])  # another key's valid value
        pipe.close()
        # read by another pipe (as another process would): the writer's own pipe answers
        # its misses from its read-your-writes record, without recomputing
        pipe = ac.AsyncKVCacheMapDataPipe(source, ac.connect(redis_server.url), prefetch=64,
                                          namespace=namespace)
        source.calls = 0
        assert [pipe[i] for i in range(len(values))] == values
        assert source.calls == len(values)
        assert pipe.stats()["decode_errors"] >= len(values)
    finally:
        raw.close()
        pipe.close()


@pytest.mark.parametrize("kind", ["redis", "memcached"])
@pytest.mark.parametrize("size", [200, BIG, 512 << 10])
def test_a_consumer_away_longer_than_the_timeout_gets_its_read_ahead(
    request: pytest.FixtureRequest, namespace: str, kind: str, size: int
) -> None:
    """A training step longer than ``timeout`` between reads: the read-ahead sent before
    it sits in the socket (or, held back by a full socket, in the server); that is not
    a slow server, so it is read, not timed out."""
    server = request.getfixturevalue(f"{kind}_server")
    values = _values(64, size)
    source = Computed(values)
    pipe = ac.AsyncKVCacheMapDataPipe(source, ac.connect(server.url, timeout=0.3),
                                      prefetch=64, readahead_bytes=64 << 20,
                                      namespace=namespace)
    try:
        _warm(pipe, len(values))
        source.calls = 0
        for i in range(len(values)):
            assert pipe[i] == values[i]
            if i % 16 == 1:
                time.sleep(0.5)  # away: read-ahead of up to 64 values is in flight
        assert source.calls == 0
        stats = pipe.stats()
        assert stats["timeouts"] == 0 and stats["errors"] == 0
    finally:
        pipe.close()
