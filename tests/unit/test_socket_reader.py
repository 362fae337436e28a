"""SocketReader against a scripted consumer connection: no network, no loop.

The connection answers each request from a dict, in order, and fails when the script
says so. What is checked: a connection whose read raised is dropped together with
everything queued on it, so no reply is ever matched to another request.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import asynccache as ac
from asynccache.cache.core import AsyncKVCache
from asynccache.cache.markers import MISSING
from asynccache.cache.port import CachePort, CacheSettings, Keyspace
from asynccache.readahead.readers import SocketReader, Ticket
from asynccache.store.api import NOT_READ, ConsumerConnection, ConsumerReads


class ScriptedConnection(ConsumerConnection):
    """Answers every request at once (queued until polled); ``fail_on`` lists the
    numbers of the requests (0, 1, ...) whose send raises. Like a careless provider's
    connection, it keeps what it queued when a send raises: only close() drops it."""

    def __init__(self, store: dict[bytes, bytes], fail_on: Sequence[int] = (),
                 short_on: Sequence[int] = ()) -> None:
        self.node = "scripted"
        self.store = store
        self.fail_on = set(fail_on)
        self.short_on = set(short_on)  # requests answered with one value too few
        self.sent = 0
        self.closed = 0
        self.replies: collections.deque[list[Any]] = collections.deque()

    def send_get(self, keys: Sequence[bytes]) -> None:
        n, self.sent = self.sent, self.sent + 1
        if n in self.fail_on:
            raise ac.StoreUnavailable(f"scripted failure of request {n}")
        reply = [self.store.get(k) for k in keys]
        self.replies.append(reply[:-1] if n in self.short_on else reply)

    def poll(self, limit: int | None = None) -> list[list[Any]]:
        n = len(self.replies) if limit is None else min(limit, len(self.replies))
        return [self.replies.popleft() for _ in range(n)]

    def receive(self) -> list[Any]:
        return self.replies.popleft()

    def close(self) -> None:
        self.closed += 1
        self.replies.clear()


def _source(conn: ScriptedConnection) -> tuple[SocketReader, AsyncKVCache]:
    settings = CacheSettings(ac.connect("memory://socket-source"), Keyspace("unit"))
    port = CachePort(None, settings)  # type: ignore[arg-type]  # no loop: never used
    reads = ConsumerReads([conn], lambda keys: [(0, list(range(len(keys))))])
    return SocketReader(port, reads, loop=None), port.cache  # type: ignore[arg-type]


def _store(cache: AsyncKVCache, n: int) -> dict[bytes, bytes]:
    return {cache.key(i): cache.codec.encode(f"value {i}", cache.key(i)) for i in range(n)}


def _ticket(cache: AsyncKVCache, indices: list[int]) -> Ticket:
    return Ticket(indices, [cache.key(i) for i in indices])


def test_a_connection_that_fails_mid_queue_is_dropped_with_what_it_queued() -> None:
    cache = AsyncKVCache(ac.connect("memory://socket-source"), namespace="unit")
    conn = ScriptedConnection(_store(cache, 20), fail_on=[2])
    source, cache = _source(conn)
    conn.store = _store(cache, 20)
    first, second = _ticket(cache, [0, 1, 2]), _ticket(cache, [3, 4, 5])
    source.submit(first)   # answered and queued in the connection, not polled yet
    source.submit(second)  # queued too
    failing = _ticket(cache, [6, 7, 8])
    source.submit(failing)  # raises inside: the connection must be dropped whole
    assert conn.closed == 1 and not conn.replies
    assert failing.done and failing.partial and failing.values == [NOT_READ] * 3
    cache.policy.succeeded(conn.node)  # its back-off over: the store is asked again
    later = _ticket(cache, [9, 10, 11])
    source.submit(later)
    done = source.poll() + ([] if later.done else [later] * source.wait(later))
    assert later.done and later.values == ["value 9", "value 10", "value 11"]
    # the requests queued before the failure are lost (not read), never someone else's
    for ticket in (first, second):
        assert ticket.done and ticket.partial and ticket.values == [NOT_READ] * 3
    assert first in done or first.done
    stats = cache.stats()
    assert stats["errors"] == 1 and stats["decode_errors"] == 0


def test_a_reply_of_the_wrong_length_drops_the_connection() -> None:
    cache = AsyncKVCache(ac.connect("memory://socket-source"), namespace="unit")
    conn = ScriptedConnection(_store(cache, 20), short_on=[1])
    source, cache = _source(conn)
    conn.store = _store(cache, 20)
    tickets = [_ticket(cache, [3 * n, 3 * n + 1, 3 * n + 2]) for n in range(3)]
    for ticket in tickets:
        source.submit(ticket)
    source.poll()
    assert all(t.done for t in tickets)
    assert tickets[0].values == ["value 0", "value 1", "value 2"]
    assert tickets[1].values == [NOT_READ] * 3 and tickets[1].partial
    assert tickets[2].values == [NOT_READ] * 3  # queued behind it on a stream not trusted
    assert conn.closed == 1
    cache.policy.succeeded(conn.node)
    after = _ticket(cache, [12, 13])
    source.submit(after)
    source.poll()
    assert after.values == ["value 12", "value 13"]


def test_misses_and_values_are_told_apart_after_a_drop() -> None:
    cache = AsyncKVCache(ac.connect("memory://socket-source"), namespace="unit")
    conn = ScriptedConnection(_store(cache, 4), fail_on=[1])
    source, cache = _source(conn)
    conn.store = _store(cache, 4)
    source.submit(_ticket(cache, [0, 1]))
    source.submit(_ticket(cache, [2, 3]))  # fails
    cache.policy.succeeded(conn.node)
    probe = _ticket(cache, [5, 0])  # 5 was never stored
    source.submit(probe)
    source.poll()
    assert probe.values == [MISSING, "value 0"]
