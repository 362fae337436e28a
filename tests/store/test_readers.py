"""The consumer-side read source on a real server: how much work one wait costs.

A consumer that waits for the oldest request must not pay for receiving and decoding
every reply that arrived behind it (a window of large values is tens of MiB): those
are left for the reads that need them.
"""

from __future__ import annotations

import fcntl
import termios
import time

import asynccache as ac
from asynccache.cache.keys import Keyspace
from asynccache.cache.settings import CacheSettings
from asynccache.readahead.readers import SocketReader, Ticket
from asynccache.readahead.runtime import ProcessRuntime
from asynccache.store.redis.consumer import BlockingRespConnection
from asynccache.testing import servers


def _source(url: str, namespace: str) -> tuple[ProcessRuntime, SocketReader]:
    client = ac.connect(url)
    runtime = ProcessRuntime(CacheSettings(client, Keyspace(namespace)))
    source = runtime.new_reader()
    assert isinstance(source, SocketReader)
    return runtime, source


def _unread(conn: BlockingRespConnection) -> int:
    """Bytes the kernel holds for ``conn``'s socket, not read yet."""
    assert conn.sock is not None
    buf = bytearray(4)
    fcntl.ioctl(conn.sock.fileno(), termios.FIONREAD, buf)
    return int.from_bytes(buf, "little")


def test_advance_decodes_no_further_than_the_ticket_it_waits_for(
    redis_server: servers.RedisServer, namespace: str
) -> None:
    # 8 requests of 8 KiB: all of it fits in the socket's receive buffer at once
    values = {i: bytes([i]) * (8 << 10) for i in range(8)}
    pipe = ac.AsyncKVCacheMapDataPipe(list(values.values()), ac.connect(redis_server.url),
                                      prefetch=0, namespace=namespace)
    try:
        assert [pipe[i] for i in values] == list(values.values())  # computed, written
        pipe.flush()
        _runtime, source = _source(redis_server.url, namespace)
        tickets = [Ticket([i], [pipe.key_for(i)]) for i in values]
        for ticket in tickets:
            source.submit(ticket)
        conn = source.conns[0]
        deadline = time.monotonic() + 5  # let every reply reach this side's socket
        while _unread(conn) < sum(map(len, values.values())) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _unread(conn) >= sum(map(len, values.values()))
        done = source.advance(tickets[0])
        assert done == [tickets[0]]  # the others arrived too, but wait their turn
        assert not any(t.done for t in tickets[1:])
        assert tickets[0].values == [values[0]]
        rest = source.poll()  # an unbounded poll takes everything that is there
        while len(rest) < len(tickets) - 1:
            assert source.wait(tickets[-1])
            rest += source.poll()
        assert [t.values[0] for t in rest] == [values[i] for i in range(1, 8)]
        source.close()
    finally:
        pipe.close()


def test_a_read_outside_the_plan_is_sent_before_the_read_ahead_it_starts(
    redis_server: servers.RedisServer, namespace: str
) -> None:
    """Reading i, i+1 switches to sequential read-ahead; i+1's own read goes first, so
    it does not wait behind the new window (64 values of 256 KiB here)."""
    n = 80
    values = [bytes([i % 251]) * (256 << 10) for i in range(n)]
    pipe = ac.AsyncKVCacheMapDataPipe(values, ac.connect(redis_server.url), prefetch=64,
                                      namespace=namespace)
    try:
        assert [pipe[i] for i in range(n)] == values  # written
        pipe.flush()
        sent: list[list[bytes]] = []
        original = BlockingRespConnection.send_get

        def spy(self: BlockingRespConnection, keys: list[bytes]) -> None:
            sent.append(list(keys))
            original(self, keys)

        BlockingRespConnection.send_get = spy  # type: ignore[method-assign]
        try:
            assert pipe[10] == values[10] and pipe[11] == values[11]
        finally:
            BlockingRespConnection.send_get = original  # type: ignore[method-assign]
        key_11 = pipe.key_for(11)
        first_with_11 = next(n for n, keys in enumerate(sent) if key_11 in keys)
        ahead = [n for n, keys in enumerate(sent) if pipe.key_for(12) in keys]
        assert ahead, "reading 10, 11 should have started read-ahead from 12"
        assert first_with_11 < ahead[0]
    finally:
        pipe.close()


def test_read_ahead_is_per_node_on_a_cluster(redis_cluster: servers.RedisCluster,
                                             namespace: str) -> None:
    """prefetch counts per node: a batch spread over 3 primaries keeps each node's share
    of it as large as one server's would be."""
    values = [b"v%d" % i for i in range(50)]
    pipe = ac.AsyncKVCacheMapDataPipe(values, ac.connect(redis_cluster.url), prefetch=16,
                                      namespace=namespace)
    try:
        assert [pipe[i] for i in range(50)] == values
        prefetcher = pipe._runtime().prefetcher()
        assert prefetcher.reader.fanout == len(redis_cluster.nodes) == 3
        assert prefetcher.prefetch == 16 * 3
    finally:
        pipe.close()
