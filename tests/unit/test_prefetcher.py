"""The prefetcher against a scripted fake source: no network, no threads, no loop.

The fake completes tickets when the test says so (or when the consumer waits), with
values, misses, per-key failures (``NOT_READ`` plus an error) or not at all (deadline),
so every path of the plan / window / ready logic can be driven exactly.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

import asynccache as ac
from asynccache.cache.markers import MISSING, Failed
from asynccache.readahead.prefetch import Prefetcher
from asynccache.readahead.readers import Reader, Ticket
from asynccache.readahead.window import (
    FIRST_BATCH,
    FIRST_WINDOW,
    SMALL_WINDOW_BYTES,
    batch_size_for,
    sized_window,
)
from asynccache.store.api import NOT_READ


def key_of(index: Any) -> bytes:
    return repr(index).encode()


class ScriptedReader(Reader):
    """Completes tickets from ``store`` (index -> value); scripted faults per index.

    ``auto``: tickets complete as soon as they are submitted (the store answers at once).
    Otherwise they stay in flight until :meth:`complete` or until the consumer waits:
    ``wait`` completes the ticket unless ``hang`` is set (then it reports a deadline).
    ``down``: indices whose node fails (``NOT_READ``, ``error`` set).
    """

    def __init__(self, store: dict[Any, Any], *, auto: bool = False,
                 value_bytes: int = 0) -> None:
        self.store = store
        self.value_bytes = value_bytes  # what each value found "carried" on the wire
        self.auto = auto
        self.hang = False
        self.down: set[Any] = set()
        self.error = ac.StoreTimeout("scripted timeout")
        self.submitted: list[Ticket] = []
        self.in_flight: list[Ticket] = []
        self.completed: list[Ticket] = []

    def submit(self, ticket: Ticket) -> None:
        self.submitted.append(ticket)
        self.in_flight.append(ticket)
        if self.auto:
            self.complete(ticket)

    def complete(self, ticket: Ticket | None = None) -> None:
        ticket = ticket or self.in_flight[0]
        self.in_flight.remove(ticket)
        values = []
        for index in ticket.indices:
            if index in self.down:
                values.append(NOT_READ)
                ticket.partial = True
                ticket.error = self.error
            else:
                values.append(self.store.get(index, MISSING))
        ticket.values = values
        ticket.nbytes = self.value_bytes * sum(v is not MISSING and v is not NOT_READ
                                               for v in values)
        ticket.done = True
        self.completed.append(ticket)

    def complete_all(self) -> None:
        while self.in_flight:
            self.complete()

    def poll(self) -> list[Ticket]:
        out, self.completed = self.completed, []
        return out

    def wait(self, ticket: Ticket) -> bool:
        if self.hang:
            return False
        if not ticket.done:
            self.complete(ticket)
        return True

    @property
    def requested(self) -> list[Any]:
        return [i for t in self.submitted for i in t.indices]


def make(store: dict[Any, Any], prefetch: int = 8, *, length: int | None = 100,
         strict: bool = False, auto: bool = False, value_bytes: int = 0,
         prefetch_bytes: int = 32 << 20) -> tuple[Prefetcher, ScriptedReader]:
    source = ScriptedReader(store, auto=auto, value_bytes=value_bytes)
    return Prefetcher(source, key_of, length, prefetch, strict, prefetch_bytes), source


def full_store(n: int = 100) -> dict[int, str]:
    return {i: f"v{i}" for i in range(n)}


def test_batch_size_keeps_two_requests_in_flight() -> None:
    assert batch_size_for(0) == 0
    assert batch_size_for(8) == 8 and batch_size_for(64) == 32 and batch_size_for(1024) == 256


def test_planned_reads_are_prefetch_hits_in_batches() -> None:
    p, source = make(full_store(), prefetch=32)
    p.set_plan(list(range(100)))
    # sizes unknown: a first window of FIRST_WINDOW; a reply grows it to the full 32
    assert source.requested == list(range(FIRST_WINDOW))
    source.complete_all()
    got = []
    for i in range(100):
        got.append(p.take(i))
        source.complete_all()
    assert got == [f"v{i}" for i in range(100)]
    assert p.counts["prefetch_hits"] == 100
    assert p.counts["stalls"] == 0
    assert p.counts["direct_reads"] == 0
    assert p.counts["hits"] == 100 and p.counts["misses"] == 0
    # a first window in small requests, then requests of 16 once a reply came back
    assert [len(t.indices) for t in source.submitted] == [FIRST_BATCH] * 4 + [16] * 5 + [4]
    assert not p.inflight and not p.ready


def test_window_bounds_what_is_requested_ahead() -> None:
    p, source = make(full_store(), prefetch=16)
    p.set_plan(list(range(100)))
    for i in range(50):
        p.take(i)
        ahead = len(p.inflight) + len(p.ready)
        assert ahead <= 16
    assert max(source.requested) < 50 + 16


def test_a_value_still_in_flight_is_waited_for_as_a_stall() -> None:
    p, _source = make(full_store(), prefetch=8)
    p.set_plan(list(range(20)))
    assert p.take(0) == "v0"  # waited: the source completes it in wait()
    assert p.counts["stalls"] == 1
    assert p.counts["prefetch_hits"] == 0
    assert p.counts["direct_reads"] == 0


def test_unplanned_index_is_one_direct_read() -> None:
    p, source = make(full_store(), prefetch=0)
    assert p.take(42) == "v42"
    assert p.counts["direct_reads"] == 1 and [t.indices for t in source.submitted] == [[42]]
    assert source.submitted[0].direct


def test_sequential_reads_switch_to_read_ahead() -> None:
    p, source = make(full_store(), prefetch=8, auto=True)
    assert [p.take(i) for i in (10, 11)] == ["v10", "v11"]
    # two in a row: 11's own read first, read-ahead from 12 pipelined right behind it
    # (in front, 11 would wait for the whole window: tens of MiB of large values)
    assert source.requested == [10, 11, *range(12, 20)]
    for i in range(12, 40):
        assert p.take(i) == f"v{i}"
    assert p.counts["direct_reads"] == 2 and p.counts["prefetch_hits"] == 28


def test_keyed_sources_have_no_sequential_guess() -> None:
    p, source = make({"a": 1, "b": 2}, prefetch=8, length=None, auto=True)
    assert p.take("a") == 1 and p.take("b") == 2
    assert p.counts["direct_reads"] == 2 and len(source.submitted) == 2


def test_read_ahead_failure_is_dropped_and_read_again_later() -> None:
    """A failed batch leaves no stale misses: once the store is back it is used again."""
    p, source = make(full_store(), prefetch=16)
    source.down = set(range(8, 16))
    p.set_plan(list(range(40)))
    source.complete_all()
    assert p.take(0) == "v0"
    assert all(i not in p.inflight for i in range(16))  # delivered or dropped, never stuck
    assert 8 not in p.ready and 7 in p.ready
    for i in range(1, 8):
        assert p.take(i) == f"v{i}"
    source.down = set()  # the store came back
    source.auto = True
    assert [p.take(i) for i in range(8, 16)] == [f"v{i}" for i in range(8, 16)]
    assert p.counts["direct_reads"] == 8 and p.counts["misses"] == 0


def test_waiting_on_a_failed_batch_is_a_miss_in_fallback() -> None:
    p, source = make(full_store(), prefetch=8)
    p.set_plan(list(range(20)))
    source.down = set(range(8))
    source.auto = True
    # the in-flight batch fails while the consumer waits for index 0; the direct read
    # that follows fails too (the node is still down): a miss, computed by the caller
    assert p.take(0) is MISSING
    assert p.counts["misses"] == 1 and 0 not in p.inflight


def test_raise_mode_raises_fresh_errors_only() -> None:
    p, source = make(full_store(), prefetch=8, strict=True)
    p.set_plan(list(range(30)))
    source.down = set(range(8))
    with pytest.raises(ac.StoreTimeout):
        p.take(0)  # waited on the failed batch: its error, now
    source.down = set()
    source.auto = True
    # the store is back: the failed indices are read again, no stale error
    assert [p.take(i) for i in range(1, 8)] == [f"v{i}" for i in range(1, 8)]
    assert p.take(0) == "v0"


def test_raise_mode_does_not_raise_for_a_batch_nobody_waits_for() -> None:
    p, source = make(full_store(), prefetch=16, strict=True)
    p.set_plan(list(range(40)))
    source.down = set(range(8, 16))
    source.complete_all()
    source.down = set()
    source.auto = True
    assert [p.take(i) for i in range(16)] == [f"v{i}" for i in range(16)]


def test_deadline_abandons_the_ticket_and_ignores_its_late_result() -> None:
    p, source = make(full_store(), prefetch=8)
    p.set_plan(list(range(20)))
    source.hang = True
    assert p.take(0) is MISSING  # the in-flight batch and the direct read both time out
    assert p.counts["stall_timeouts"] == 2  # the abandoned batch left the window:
    assert not any(i in p.inflight for i in range(FIRST_BATCH))
    source.hang = False
    source.complete_all()  # the late results arrive
    p.take(1)
    assert 2 not in p.ready  # the abandoned batch's values were ignored
    source.auto = True
    assert p.take(2) == "v2"


def test_deadline_in_raise_mode_raises_a_timeout() -> None:
    p, source = make(full_store(), prefetch=0, strict=True)
    source.hang = True
    with pytest.raises(ac.StoreTimeout):
        p.take(3)


def test_read_ahead_miss_out_of_plan_order_is_read_again() -> None:
    store: dict[int, str] = {}
    p, _source = make(store, prefetch=16, auto=True)
    p.set_plan(list(range(40)))  # everything read ahead as misses
    store.update(full_store(40))  # ... then another worker writes them
    assert p.take(0) is MISSING  # in plan order: the miss is trusted
    assert p.take(10) == "v10"  # out of order: read again, found
    assert p.take_many([20, 12]) == ["v20", "v12"]


def test_decode_failure_raises_only_for_its_index_in_raise_mode() -> None:
    store: dict[int, Any] = {**full_store(20), 3: Failed(ac.DecodeError("bad bytes"))}
    p, _source = make(store, prefetch=8, strict=True, auto=True)
    p.set_plan(list(range(20)))
    assert [p.take(i) for i in range(3)] == ["v0", "v1", "v2"]
    with pytest.raises(ac.DecodeError):
        p.take(3)
    assert p.take(4) == "v4"


def test_order_is_replanned_each_epoch_and_an_empty_replan_stops() -> None:
    epochs: list[list[int]] = [[5, 3, 1], [2, 4], []]
    p, _source = make(full_store(), prefetch=8, auto=True)

    def replan(first: int | None = None) -> list[int]:
        return epochs.pop(0) if epochs else []

    p.set_plan(replan(), replan)
    assert [p.take(i) for i in (5, 3, 1)] == ["v5", "v3", "v1"]
    assert [p.take(i) for i in (2, 4)] == ["v2", "v4"]  # the next epoch's plan
    assert p.counts["direct_reads"] == 0
    assert p.take(7) == "v7"  # the order ran dry: a direct read, no recursion
    assert p.replan is None


def test_take_many_mixes_ready_in_flight_and_direct() -> None:
    p, source = make(full_store(), prefetch=16)
    p.set_plan(list(range(16)))
    source.complete(source.in_flight[0])  # 0..7 ready, 8..15 in flight
    got = p.take_many([0, 1, 9, 50, 51, 50])
    assert got == ["v0", "v1", "v9", "v50", "v51", "v50"]
    direct = [t for t in source.submitted if t.direct]
    assert [t.indices for t in direct] == [[50, 51]]  # one request for the rest, deduped


def test_wrong_guesses_cost_at_most_one_pass_over_the_plan() -> None:
    rng = random.Random(1)
    p, source = make(full_store(400), prefetch=32, length=400, auto=True)
    p.set_plan(list(range(400)))
    reads = [rng.randrange(400) for _ in range(300)]
    assert [p.take(i) for i in reads] == [f"v{i}" for i in reads]
    assert len(source.requested) <= len(reads) + 400
    assert len(p.ready) <= 2 * 32 + 16


def test_replan_drops_the_old_window() -> None:
    p, source = make(full_store(), prefetch=16)
    p.set_plan(list(range(50)))
    p.set_plan(list(range(50, 100)))
    source.complete_all()  # the old plan's tickets complete late
    p.take(50)
    assert all(i not in p.ready for i in range(16))
    assert p.counts["prefetch_wasted"] == 0 or p.counts["prefetch_wasted"] <= 16


def test_values_equal_the_store_under_random_faults() -> None:
    """Whatever fails, a value handed out is the store's value for that index."""
    rng = random.Random(7)
    store = full_store(200)
    p, source = make(store, prefetch=24, length=200)
    order = list(range(200))
    rng.shuffle(order)
    p.set_plan(order, lambda _first=None: list(order))
    for _ in range(3):
        for i in order:
            source.down = {j for j in range(200) if rng.random() < 0.2}
            source.hang = rng.random() < 0.05
            value = p.take(i)
            assert value is MISSING or value == store[i]
            if rng.random() < 0.5:
                source.complete_all()
    assert p.counts["hits"] + p.counts["misses"] == 600


# -- read-ahead bounded in bytes ---------------------------------------------------------
MIB = 1 << 20


def test_sized_window_bounds_items_by_bytes() -> None:
    assert sized_window(64, 32 * MIB, 0) == (64, 32)          # sizes unknown: items only
    # small values: the window grows to 4 x prefetch while it holds at most 1 MiB
    assert sized_window(64, 32 * MIB, 100) == (256, 128)
    assert sized_window(64, 32 * MIB, 4096) == (256, 128)
    assert sized_window(64, 32 * MIB, 8192) == (128, 64)
    assert sized_window(64, 32 * MIB, 16384) == (64, 32)      # from 16 KiB on: prefetch
    assert sized_window(64, 64 * 1024, 100) == (256, 20)      # requests <= prefetch_bytes/32
    assert sized_window(1, 32 * MIB, 100) == (4, 4)
    assert sized_window(64, 32 * MIB, 256 * 1024) == (64, 4)  # 1 MiB requests
    assert sized_window(64, 32 * MIB, MIB) == (32, 1)
    assert sized_window(64, 32 * MIB, 4 * MIB) == (8, 1)
    assert sized_window(64, 32 * MIB, 50 * MIB) == (1, 1)     # one huge value: still read
    assert sized_window(0, 32 * MIB, MIB) == (0, 0)           # prefetch=0 stays off


def _scan(p: Prefetcher, source: ScriptedReader, n: int) -> tuple[list[Any], int]:
    """Read 0..n-1 in order, completing one request at a time; the most items ever
    requested ahead (in flight + ready)."""
    got, most = [], 0
    for i in range(n):
        if source.in_flight:
            source.complete()
        got.append(p.take(i))
        most = max(most, len(p.inflight) + len(p.ready))
    return got, most


@pytest.mark.parametrize(("value_bytes", "window", "batch"),
                         [(100, 256, 128), (32 * 1024, 64, 32), (MIB, 32, 1), (4 * MIB, 8, 1),
                          (50 * MIB, 1, 1)])
def test_large_values_shrink_requests_and_window(value_bytes: int, window: int,
                                                 batch: int) -> None:
    p, source = make(full_store(200), prefetch=64, length=200, value_bytes=value_bytes)
    p.set_plan(list(range(200)))
    assert [len(t.indices) for t in source.submitted] == [FIRST_BATCH] * (FIRST_WINDOW
                                                                          // FIRST_BATCH)
    got, most = _scan(p, source, 200)
    assert got == [f"v{i}" for i in range(200)]
    assert (p.window, p.batch) == (window, batch)
    assert most <= max(window, FIRST_WINDOW) + batch  # in flight + ready stays bounded
    later = source.submitted[FIRST_WINDOW // FIRST_BATCH + 1:]  # sizes known by then
    assert later and max(len(t.indices) for t in later) <= batch
    assert p.counts["direct_reads"] == 0  # read ahead all along, just in smaller requests


def test_replies_without_bytes_end_the_small_first_window_but_teach_no_size() -> None:
    p, source = make({}, prefetch=64, length=200)  # a cold epoch: every read a miss
    p.set_plan(list(range(200)))
    source.complete_all()
    p.take(0)
    assert (p.window, p.batch) == (64, 32) and p.item_bytes == 0
    # a warm epoch after it: the first reply with bytes sizes the window at once
    source.store.update(full_store(200))
    source.value_bytes = 4 * MIB
    source.complete_all()
    for i in range(1, 100):
        p.take(i)
        source.complete_all()
    assert (p.window, p.batch) == (8, 1) and p.item_bytes == pytest.approx(4 * MIB, rel=0.3)
    # misses (0 bytes) later do not make the estimate forget the values' size
    before = p.item_bytes
    source.store.clear()
    for i in range(100, 150):
        p.take(i)
        source.complete_all()
    assert p.item_bytes == before and (p.window, p.batch) == (8, 1)


def test_a_small_prefetch_regains_its_full_batches_after_the_first_reply() -> None:
    """prefetch=8 is already inside the first window: its requests are still 4 until a
    reply comes, then those of its window grown for 100 B values (32 items, requests of
    16), not 4 forever."""
    p, source = make(full_store(), prefetch=8, value_bytes=100)
    p.set_plan(list(range(100)))
    assert [len(t.indices) for t in source.submitted] == [FIRST_BATCH, FIRST_BATCH]
    got, _most = _scan(p, source, 100)
    assert got == [f"v{i}" for i in range(100)]
    assert (p.window, p.batch) == (32, batch_size_for(32))
    assert max(len(t.indices) for t in source.submitted[2:]) == batch_size_for(32)


def test_a_window_grown_for_small_values_reads_little_in_vain() -> None:
    """The grown window is what an order change throws away: 256 values of 100 B, never
    more than SMALL_WINDOW_BYTES; and a mix that turns large shrinks it again."""
    p, source = make(full_store(2000), prefetch=64, length=2000, value_bytes=100)
    p.set_plan(list(range(2000)))
    _scan(p, source, 300)
    assert (p.window, p.batch) == (256, 128)
    source.complete_all()
    assert len(p.ready) + len(p.inflight) <= 256 + 128
    p.set_plan(list(range(1999, 0, -1)))  # a new order: what was read ahead is dropped
    wasted = p.counts["prefetch_wasted"]
    assert 0 < wasted <= 256 + 128 and wasted * 100 <= SMALL_WINDOW_BYTES
    source.value_bytes = 64 * 1024
    for i in range(1999, 1700, -1):
        source.complete_all()
        assert p.take(i) == f"v{i}"
    assert p.window == 64 and p.batch <= 32  # 64 KiB values: prefetch, not grown



def test_misses_do_not_grow_the_window_for_large_values() -> None:
    """A cold epoch of 400 KiB values, 1 in 100 already cached, averages ~13 KiB an item.
    Growth follows the size of the values found, not that average: otherwise the warm
    epoch's first requests would be 4 x larger than prefetch allows (~100 MiB in flight)."""
    store = {i: f"v{i}" for i in range(0, 2000, 100)}
    p, source = make(store, prefetch=64, length=2000, value_bytes=400 * 1024)
    p.set_plan(list(range(2000)))
    _scan(p, source, 2000)
    assert 0 < p.item_bytes < 50 * 1024  # the mix: misses dilute it
    assert p.value_bytes == pytest.approx(400 * 1024)
    assert p.window <= 64  # not grown
    small = {i: f"v{i}" for i in range(2000)}  # and 100 B values, all found, still grow
    q, source = make(small, prefetch=64, length=2000, value_bytes=100)
    q.set_plan(list(range(2000)))
    _scan(q, source, 600)
    assert (q.window, q.batch) == (256, 128)

# -- the epoch clock of a followed order ---------------------------------------------------
@pytest.mark.parametrize("batched", [True, False])
def test_a_miss_read_ahead_in_one_epoch_is_read_again_in_the_next(batched: bool) -> None:
    """A worker's plan can be wrong (an unseeded sampler draws another permutation in
    each process). Its read-ahead then finds misses that the other worker computes later
    in the epoch; after the epoch's count of reads, those misses must be read again, not
    trusted: they would recompute values written in the epoch before."""
    store: dict[Any, Any] = {}
    p, source = make(store, prefetch=8, length=100)
    epoch = list(range(10))
    p.follow(epoch, lambda _first=None: list(epoch))
    source.complete_all()
    assert source.requested == list(range(8))  # read ahead: all misses, delivered below
    reads = [[50, 12, 33, 71, 28], [90, 45, 17, 60, 81]]  # what the DataLoader really sent
    for n, batch in enumerate(reads):
        got = p.take_many(batch) if batched else [p.take(i) for i in batch]
        assert got == [MISSING] * 5
        assert p.epoch_ends() == (n == 1)  # the 10th read completes the epoch
    assert [p.ready.get(i) for i in range(8)] == [MISSING] * 8  # stale by now
    store.update({i: f"v{i}" for i in range(10)})  # the other worker computed them
    if batched:
        assert p.take_many([0, 1, 2]) == ["v0", "v1", "v2"]
    else:
        assert [p.take(i) for i in (0, 1, 2)] == ["v0", "v1", "v2"]
    assert not p.epoch_ends()
    assert p.counts["misses"] == 10 and p.counts["hits"] == 3


def test_the_epoch_clock_costs_a_right_plan_nothing() -> None:
    """With the plan right, an epoch ends exactly where the plan does: no extra reads."""
    store = full_store(40)
    p, _source = make(store, prefetch=8, length=40, auto=True)
    epoch = list(range(40))
    p.follow(epoch, lambda _first=None: list(epoch))
    for _ in range(3):
        for start in range(0, 40, 8):
            assert p.take_many(epoch[start:start + 8]) == [f"v{i}" for i in epoch[start:start + 8]]
    assert p.counts["direct_reads"] == 0 and p.counts["prefetch_wasted"] == 0


def test_a_turn_reads_the_forgotten_misses_ahead_again() -> None:
    """The turn forgets stale misses and rewinds the plan to the current position: the
    misses it forgot are read ahead again, not one direct round trip each."""
    store: dict[Any, Any] = {}
    p, source = make(store, prefetch=8, length=100)
    epoch = list(range(10))
    p.follow(epoch, lambda _first=None: list(epoch))
    source.complete_all()
    for i in [50, 12, 33, 71, 28, 90, 45, 17, 60, 81]:  # the epoch the loader really sent
        assert p.take(i) is MISSING
    store.update({i: f"v{i}" for i in range(10)})  # written by the other worker
    got = []
    for i in range(8):
        got.append(p.take(i))
        source.complete_all()
    assert got == [f"v{i}" for i in range(8)]
    # the first read is direct (its miss was forgotten); the next 7 should be read ahead
    assert p.counts["direct_reads"] - 10 <= 1, p.counts


def test_a_shifted_clock_keeps_the_hits_in_flight() -> None:
    """Reads outside the loader's epoch (here 8 peeks before training, 0 workers) shift
    the clock for good: it then turns inside every epoch of a right plan. A turn keeps
    the read-ahead in flight (hits are never stale), so this costs no direct read."""
    store = full_store(100)
    p, _source = make(store, prefetch=8, length=100, auto=True)
    epoch = list(range(40))
    p.follow(epoch, lambda _first=None: list(epoch))
    for i in (90, 70, 50, 95, 75, 55, 85, 65):  # e.g. looking at a few samples first
        assert p.take(i) == f"v{i}"
    peeked = p.counts["direct_reads"]
    for _ in range(3):
        for start in range(0, 40, 8):
            assert p.take_many(epoch[start:start + 8]) == [f"v{i}" for i in epoch[start:start + 8]]
    assert p.counts["direct_reads"] == peeked, p.counts


@pytest.mark.parametrize("batched", [True, False])
def test_forgotten_misses_count_as_wasted_on_either_path(batched: bool) -> None:
    """The 8 misses read ahead and forgotten at the turn are wasted, by take or take_many."""
    store: dict[Any, Any] = {}
    p, source = make(store, prefetch=8, length=100)
    epoch = list(range(10))
    p.follow(epoch, lambda _first=None: list(epoch))
    source.complete_all()
    for i in [50, 12, 33, 71, 28, 90, 45, 17, 60, 81]:
        assert p.take(i) is MISSING
    if batched:
        p.take_many([0])
    else:
        p.take(0)
    assert p.counts["prefetch_wasted"] == 8, p.counts


@pytest.mark.parametrize("clock", [True, False])
def test_a_varying_count_per_epoch_costs_no_extra_reads(clock: bool) -> None:
    """DataLoader(in_order=False) hands a busy worker's batch to another: the count per
    epoch varies. Worker 0's share is batches 0, 2, 4, 6 (a right guess); in epoch 1 its
    batch 4 went to worker 1. The clock then turns mid-plan in epoch 2: with it or without
    it, the only direct reads are that batch's (which came off the plan)."""
    store = full_store(100)
    p, _source = make(store, prefetch=8, length=100, auto=True)
    batches = [list(range(b * 8, b * 8 + 8)) for b in (0, 2, 4, 6)]
    share = [i for b in batches for i in b]
    p.follow(share, lambda _first=None: list(share))
    if not clock:
        p.epoch_len = 0  # no clock
    for b in (batches[0], batches[1], batches[3]):  # epoch 1: batch 4 went elsewhere
        assert p.take_many(b) == [f"v{i}" for i in b]
    for _ in range(2):
        for b in batches:
            assert p.take_many(b) == [f"v{i}" for i in b]
    assert p.counts["direct_reads"] == 8, p.counts  # epoch 1's batch off the window only


# -- an order followed across epochs ------------------------------------------------


def _epochs(n: int, count: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        perm = list(range(n))
        rng.shuffle(perm)
        out.append(perm)
    return out


def test_the_next_epochs_first_batch_is_read_ahead_across_the_boundary() -> None:
    epochs = _epochs(40, 3)
    asked: list[Any] = []

    def replan(first: Any = None) -> list[int]:
        asked.append(first)
        if first is not None:  # the epoch the order is at now: the one the guess was
            return next(e for e in epochs if e[0] == first)
        guesses = asked.count(None)
        return epochs[guesses - 1] if guesses <= len(epochs) else []

    p, _source = make(full_store(40), prefetch=16, auto=True)
    p.follow(replan(), replan)
    for epoch in epochs:
        for i in epoch:
            assert p.take(i) == f"v{i}"
    # every guess confirmed by the order at its first read
    assert asked == [None, None, epochs[1][0], None, epochs[2][0], None]
    counts = p.counts
    assert counts["direct_reads"] == 0 and counts["prefetch_hits"] == 120, counts
    assert p.replan is None  # the order ran dry after three epochs


def test_the_next_epoch_is_read_ahead_one_batch_until_its_first_read_confirms_it() -> None:
    p, source = make(full_store(64), prefetch=16, auto=True)
    p.follow(list(range(32)), lambda _first=None: list(range(32, 64)))
    for i in range(32):
        p.take(i)
    assert source.requested[32:] == list(range(32, 32 + p.batch))  # a guess: one batch
    assert p.take(32) == "v32"
    assert set(range(32, 48)) <= set(source.requested)  # confirmed: the window follows


def test_a_disproved_guess_is_replaced_by_the_epoch_of_the_first_read() -> None:
    guess, actual = _epochs(50, 2, seed=5)
    asked: list[Any] = []

    def replan(first: Any = None) -> list[int]:
        asked.append(first)
        return guess if first is None else actual

    p, _source = make(full_store(50), prefetch=16, auto=True)
    p.follow(list(range(50)), replan)
    assert [p.take(i) for i in range(50)] == [f"v{i}" for i in range(50)]
    assert asked == [None]  # the guess for the next epoch, read ahead one batch
    wasted_before = p.counts["prefetch_wasted"]
    assert [p.take(i) for i in actual] == [f"v{i}" for i in actual]
    assert asked[:2] == [None, actual[0]]  # then a guess of the epoch after it
    counts = p.counts
    # one direct read (the first, that disproved the guess); the rest read ahead
    assert counts["direct_reads"] <= 1 and counts["prefetch_hits"] >= 50 + 49 - 1, counts
    assert counts["prefetch_wasted"] - wasted_before <= p.batch
