"""The TTL rule and the write-behind queue (read-your-writes): logic with no I/O."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

import asynccache as ac
from asynccache.cache.expiry import check_ttl
from asynccache.cache.write_queue import WriteQueue


@pytest.mark.parametrize(("ttl", "seconds"), [
    (None, None), (1, 1.0), (0.25, 0.25), (datetime.timedelta(minutes=2), 120.0),
    (datetime.timedelta(milliseconds=5), 0.005)])
def test_ttl_takes_seconds_or_a_timedelta(ttl: object, seconds: float | None) -> None:
    assert check_ttl(ttl) == seconds


@pytest.mark.parametrize("ttl", [0, -1, 0.0, -0.5, datetime.timedelta(0),
                                 datetime.timedelta(seconds=-3), float("nan"), float("inf"),
                                 True, "60", [1]])
def test_ttl_that_no_store_reads_the_same_way_is_a_config_error(ttl: object) -> None:
    with pytest.raises(ac.ConfigError, match="ttl"):
        check_ttl(ttl)


def test_queued_values_are_recalled_until_acknowledged_then_read_again() -> None:
    q = WriteQueue(max_pending=100)
    wake, dropped = q.put({b"k1": b"v1"}, {b"k1": b"v1"})
    assert (wake, dropped) == (True, 0)
    assert q.put({b"k2": b"v2"}, {b"k2": b"v2"}) == (False, 0)  # a writer is at work
    assert q.own_writes([b"k1", b"k2", b"k3"]) == ({b"k1": b"v1", b"k2": b"v2"}, [], {})
    batch = q.take(1)
    assert batch is not None and batch.entries == {b"k1": b"v1"}
    assert q.own_writes([b"k1"]) == ({b"k1": b"v1"}, [], {})  # in flight: still ours to hand out
    q.done(batch)
    # acknowledged: the store has it, and its bytes are kept a while (within the budget),
    # so a miss read before the write landed needs no second store read
    assert q.own_writes([b"k1"]) == ({b"k1": b"v1"}, [], {})
    past_budget = WriteQueue(max_pending=100, keep_bytes=0)
    past_budget.put({b"k1": b"v1"}, {b"k1": b"v1"})
    acked = past_budget.take(1)
    assert acked is not None
    past_budget.done(acked)
    assert past_budget.own_writes([b"k1"]) == ({}, [b"k1"], {})  # read again from the store
    assert past_budget.take_forgotten() == 0  # a written value forgotten costs nothing
    rest = q.take(10)
    assert rest is not None and list(rest.entries) == [b"k2"]
    q.done(rest)
    assert q.take(10) is None  # the writer's turn ends ...
    assert q.put({b"k3": b"v3"}, {b"k3": b"v3"})[0]  # ... so the next put wakes one


def test_chunks_are_written_before_the_manifest_that_completes_the_value() -> None:
    q = WriteQueue(max_pending=100)
    entries = {b"c0": b"part0", b"c1": b"part1", b"k": b"manifest"}
    q.put({b"k": b"whole"}, entries)
    first = q.take(2)
    assert first is not None and list(first.entries) == [b"c0", b"c1"] and not first.values
    q.done(first)
    assert q.own_writes([b"k"]) == ({b"k": b"whole"}, [], {})  # its manifest is not written yet
    last = q.take(2)
    assert last is not None and last.values == {b"k": b"whole"}


def test_a_value_queued_again_while_in_flight_stays_recallable() -> None:
    q = WriteQueue(max_pending=100)
    q.put({b"k": b"old"}, {b"k": b"old"})
    batch = q.take(10)
    assert batch is not None
    q.put({b"k": b"new"}, {b"k": b"new"})
    q.done(batch)  # the old write landed; the new one is queued
    assert q.own_writes([b"k"]) == ({b"k": b"new"}, [], {})


def test_overflow_drops_the_oldest_and_forgets_their_values() -> None:
    q = WriteQueue(max_pending=3)
    for i in range(5):
        _wake, dropped = q.put({b"k%d" % i: b"v"}, {b"k%d" % i: b"v"})
    assert dropped == 1 and len(q) == 3
    assert q.own_writes([b"k0", b"k1", b"k4"])[0] == {b"k4": b"v"}


def test_recently_acknowledged_keys_are_bounded() -> None:
    q = WriteQueue(max_pending=100, recent=2, keep_bytes=0)
    for i in range(4):
        q.put({b"k%d" % i: b"v"}, {b"k%d" % i: b"v"})
    batch = q.take(10)
    assert batch is not None
    q.done(batch)
    assert q.own_writes([b"k0", b"k1", b"k2", b"k3"]) == ({}, [b"k2", b"k3"], {})


def test_threads_queue_while_a_writer_drains() -> None:
    q = WriteQueue(max_pending=1_000_000)
    wakes = []

    def produce(t: int) -> None:
        for i in range(2000):
            wakes.append(q.put({b"%d:%d" % (t, i): b"v"}, {b"%d:%d" % (t, i): b"v"})[0])

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    written = 0
    while any(t.is_alive() for t in threads) or len(q):
        batch = q.take(64)
        if batch is None:
            continue
        written += len(batch.entries)
        q.done(batch)
    for t in threads:
        t.join()
    assert written == 8000 and not q._unacked  # every value acknowledged


def test_queueing_nothing_leaves_the_next_write_to_wake_a_writer() -> None:
    """A batch whose misses were all answered from the record queues no value: that must
    not mark a writer at work (none starts for an empty queue), or every later write
    waits for a writer that never comes (issue 37: the store was never filled again)."""
    q = WriteQueue(max_pending=100)
    assert q.put({}, {}) == (False, 0)
    assert q.put({b"k": b"v"}, {b"k": b"v"}) == (True, 0)


def test_values_the_store_lacks_are_handed_out_to_write_again_until_written() -> None:
    q = WriteQueue(max_pending=100, acked_keep=60.0)
    for key in (b"a", b"b", b"c"):
        q.put({key: key * 10}, {key: key * 10})
    batch = q.take(10)
    assert batch is not None
    q.done(batch, written=False)  # the store was down
    assert q.unstored_values == 3 and q.kept_bytes == 30
    first = q.unstored(max_values=2, max_bytes=1 << 20)
    assert first == {b"a": b"a" * 10, b"b": b"b" * 10}  # oldest first, bounded
    q.put(first, first)
    assert q.unstored_values == 1  # in the queue now: recalled from there
    again = q.take(10)
    assert again is not None
    q.done(again, written=True)
    assert q.unstored_values == 1 and q.unstored(10, 1 << 20) == {b"c": b"c" * 10}
    assert q.own_writes([b"a"])[0] == {b"a": b"a" * 10}  # acknowledged lately: from memory


def test_acknowledged_values_leave_the_record_and_lost_ones_are_written_again() -> None:
    q = WriteQueue(max_pending=100, acked_keep=0.2, rewrite_after=0.05)
    q.put({b"k": b"v" * 100}, {b"k": b"v" * 100})
    batch = q.take(10)
    assert batch is not None
    q.done(batch)
    assert q.own_writes([b"k"]) == ({b"k": b"v" * 100}, [], {})  # a read older than the write
    time.sleep(0.1)
    # missed well after it was acknowledged: the store lost it, so the caller writes it
    assert q.own_writes([b"k"]) == ({}, [], {b"k": b"v" * 100})
    time.sleep(0.15)
    assert q.kept_bytes == 0  # the memory is given back ...
    assert q.own_writes([b"k"]) == ({}, [b"k"], {})  # ... and the store is asked again


def test_an_invalidated_key_is_not_recalled_from_the_record() -> None:
    q = WriteQueue(max_pending=100)
    q.put({b"k": b"v"}, {b"k": b"v"})
    batch = q.take(10)
    assert batch is not None
    q.done(batch, written=False)
    q.discard([b"k"])
    assert q.own_writes([b"k"]) == ({}, [], {}) and q.kept_bytes == 0


def test_a_writer_asked_for_and_never_started_is_asked_for_again() -> None:
    """An interrupt between a put() that asked for a writer and the caller starting one
    leaves the queue marked as drained by a writer that does not exist: a later put()
    asks again instead of waiting for it for ever."""
    q = WriteQueue(max_pending=100)
    assert q.put({b"a": b"1"}, {b"a": b"1"})[0]  # ... and the caller is interrupted here
    assert not q.put({b"b": b"2"}, {b"b": b"2"})[0]  # a writer is believed at work
    q._taken_at -= 5.0  # as if no writer had taken anything for 5 s
    assert q.put({b"c": b"3"}, {b"c": b"3"})[0]
