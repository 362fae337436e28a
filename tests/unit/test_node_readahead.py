"""The torchdata node's read-ahead against a scripted reader: no network, no loop
(values written back go to a ``memory://`` store in this process).

Pins what ``CachedMapper`` does with its reads -- order, batches, the window, hits,
misses, stalls, deadlines, failed nodes, epochs, items yielded twice, interrupts,
resuming -- so that the read-ahead engine under it can change without changing it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from torchdata.nodes import IterableWrapper

import asynccache as ac
from asynccache.cache.markers import MISSING
from asynccache.readahead.mapper import CachedMapper, NodeRuntime
from asynccache.readahead.readers import Reader, Ticket
from asynccache.readahead.window import WINDOW_GROWTH
from asynccache.store.api import NOT_READ

_names = itertools.count()


class KeyedReader(Reader):
    """Completes tickets from ``store`` (store key -> value), at once when ``auto``,
    else when the consumer waits (unless ``hang``: then it reports a deadline).
    ``down``: keys whose node fails (``NOT_READ``, ``error`` set). ``interrupt_at``:
    the n-th submit raises KeyboardInterrupt (once) before anything is sent."""

    def __init__(self, store: dict[bytes, Any], *, auto: bool = False) -> None:
        self.store = store
        self.auto = auto
        self.hang = False
        self.down: set[bytes] = set()
        self.error = ac.StoreTimeout("scripted timeout")
        self.interrupt_at: int | None = None
        self.submitted: list[Ticket] = []
        self.in_flight: list[Ticket] = []
        self.completed: list[Ticket] = []  # since the last poll
        self.resets = 0

    def submit(self, ticket: Ticket) -> None:
        if self.interrupt_at is not None and len(self.submitted) == self.interrupt_at:
            self.interrupt_at = None
            raise KeyboardInterrupt
        self.submitted.append(ticket)
        self.in_flight.append(ticket)
        if self.auto:
            self.complete(ticket)

    def complete(self, ticket: Ticket) -> None:
        self.in_flight.remove(ticket)
        values = []
        for key in ticket.keys:
            if key in self.down:
                values.append(NOT_READ)
                ticket.partial = True
                ticket.error = self.error
            else:
                values.append(self.store.get(key, MISSING))
        ticket.values = values
        ticket.done = True
        self.completed.append(ticket)

    def poll(self) -> list[Ticket]:
        completed, self.completed = self.completed, []
        return completed

    def wait(self, ticket: Ticket) -> bool:
        if self.hang:
            return False
        if ticket in self.in_flight:
            self.complete(ticket)
        return True

    def reset(self) -> None:
        self.resets += 1
        self.in_flight.clear()
        self.completed.clear()


class Pulled:
    """A source of ``items`` that counts how many were pulled."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.count = 0

    def __iter__(self) -> Iterator[int]:
        for item in self.items:
            self.count += 1
            yield item


def value_of(item: int) -> tuple[str, int]:
    return ("value", item)


def make(items: list[int], reader: KeyedReader, monkeypatch: pytest.MonkeyPatch,
         stored: list[int] | None = None, **options: Any) -> tuple[CachedMapper[Any], Pulled,
                                                                   list[int]]:
    """A node over ``items`` reading through ``reader``; ``stored``: items whose values
    the scripted store holds. Returns the node, its source and the map_fn's calls."""
    source = Pulled(items)
    calls: list[int] = []

    def map_fn(item: int) -> tuple[str, int]:
        calls.append(item)
        return value_of(item)

    options.setdefault("namespace", "pinned")
    node = CachedMapper(IterableWrapper(source), map_fn,
                        ac.connect(f"memory://node-pin-{next(_names)}"), **options)
    for item in stored or []:
        reader.store[node.key_for(item)] = value_of(item)
    monkeypatch.setattr(NodeRuntime, "new_reader", lambda self: reader)
    return node, source, calls


def drain(node: CachedMapper[Any], limit: int | None = None) -> list[Any]:
    node.reset()
    return take(node, limit)


def take(node: CachedMapper[Any], limit: int | None = None) -> list[Any]:
    out: list[Any] = []
    while limit is None or len(out) < limit:
        try:
            out.append(node.next())
        except StopIteration:
            break
    return out


ITEMS = list(range(200))


def test_hits_come_in_source_order_each_key_read_once_in_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reader = KeyedReader({})
    node, _, calls = make(ITEMS, reader, monkeypatch, stored=ITEMS, prefetch=32)
    assert drain(node) == [value_of(i) for i in ITEMS]
    keys = [key for ticket in reader.submitted for key in ticket.keys]
    assert keys == [node.key_for(i) for i in ITEMS]  # in order, each once
    assert max(len(t.keys) for t in reader.submitted) <= 32
    assert len(reader.submitted) >= len(ITEMS) // 32  # batches, not one read per item
    stats = node.stats()
    assert (stats["hits"], stats["misses"], calls) == (len(ITEMS), 0, [])
    node.close()


def test_items_pulled_ahead_stay_within_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = KeyedReader({})
    node, source, _ = make(ITEMS, reader, monkeypatch, stored=ITEMS, prefetch=16)
    node.reset()
    for taken in range(1, 120):
        node.next()
        assert source.count - taken <= 16 * WINDOW_GROWTH
    node.close()


def test_misses_are_computed_once_and_written_back(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = KeyedReader({})
    node, _, calls = make(ITEMS, reader, monkeypatch, stored=ITEMS[::2], prefetch=16)
    assert drain(node) == [value_of(i) for i in ITEMS]
    assert calls == ITEMS[1::2]
    node.flush()
    stats = node.stats()
    assert (stats["hits"], stats["misses"], stats["computed"]) == (100, 100, 100)

    async def stored() -> list[Any]:
        async with ac.AsyncKVCache(node.client, namespace="pinned") as cache:
            found = await cache.get_many(ITEMS[1::2])
            return [found[i] for i in ITEMS[1::2]]

    import asyncio
    assert asyncio.run(stored()) == [value_of(i) for i in ITEMS[1::2]]
    node.close()


def test_ready_values_are_prefetch_hits_and_reads_in_flight_stalls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ready = KeyedReader({}, auto=True)
    node, _, _ = make(ITEMS, ready, monkeypatch, stored=ITEMS, prefetch=16)
    drain(node)
    stats = node.stats()
    assert (stats["prefetch_hits"], stats["stalls"]) == (len(ITEMS), 0)
    node.close()
    waiting = KeyedReader({})
    node, _, _ = make(ITEMS, waiting, monkeypatch, stored=ITEMS, prefetch=16)
    drain(node)
    stats = node.stats()
    assert stats["stalls"] == len(waiting.submitted)  # one per request, on its first item
    assert stats["prefetch_hits"] == len(ITEMS) - stats["stalls"]
    node.close()


def test_a_read_past_its_deadline_is_a_counted_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = KeyedReader({})
    reader.hang = True
    node, _, calls = make(ITEMS[:40], reader, monkeypatch, stored=ITEMS, prefetch=16)
    assert drain(node) == [value_of(i) for i in ITEMS[:40]]
    stats = node.stats()
    # one per request: the others of a request past its deadline do not wait again
    # (before the one engine: one per item, each waiting on it again)
    assert stats["stall_timeouts"] == len(reader.submitted)
    assert calls == ITEMS[:40]
    node.close()


def test_a_failed_node_is_a_miss_in_fallback_and_raises_in_raise_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reader = KeyedReader({})
    node, _, calls = make(ITEMS[:40], reader, monkeypatch, stored=ITEMS[:40], prefetch=16)
    reader.down = {node.key_for(5)}
    assert drain(node) == [value_of(i) for i in ITEMS[:40]]
    assert calls == [5]
    node.close()
    reader = KeyedReader({})
    node, _, _ = make(ITEMS[:40], reader, monkeypatch, stored=ITEMS[:40], prefetch=16,
                      on_error="raise")
    reader.down = {node.key_for(5)}
    node.reset()
    assert take(node, 5) == [value_of(i) for i in range(5)]
    with pytest.raises(ac.StoreTimeout, match="scripted"):
        node.next()
    assert node.next() == value_of(6)  # the failure cost that item only
    node.close()


def test_reset_starts_again_and_abandons_reads_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reader = KeyedReader({})
    node, _, calls = make(ITEMS, reader, monkeypatch, stored=ITEMS, prefetch=16)
    assert drain(node, 10) == [value_of(i) for i in range(10)]
    before = list(reader.in_flight)
    assert before  # read-ahead was on the wire
    assert drain(node) == [value_of(i) for i in ITEMS]
    assert all(ticket.abandoned for ticket in before)
    assert calls == []
    node.close()


def test_an_item_yielded_twice_reads_the_value_written_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second read of a miss was sent before the first was computed: the value
    this process wrote is found (read your writes), not computed again."""
    items = [1, 2, 3, 1, 4, 2]
    reader = KeyedReader({})
    node, _, calls = make(items, reader, monkeypatch, prefetch=16)
    assert drain(node) == [value_of(i) for i in items]
    assert calls == [1, 2, 3, 4]
    node.close()


@pytest.mark.parametrize("at", [0, 1, 2, 3])
def test_an_interrupt_inside_next_is_repaired_by_the_next_call(
        monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """KeyboardInterrupt from the reader's ``at``-th request: it reaches the caller as
    it is; the next calls go on with right values, at most the item being pulled or
    returned lost."""
    reader = KeyedReader({})
    reader.interrupt_at = at
    node, _, _ = make(ITEMS, reader, monkeypatch, stored=ITEMS, prefetch=16)
    node.reset()
    out: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        while True:
            out.append(node.next())
    out += take(node)
    items = [value[1] for value in out]
    assert all(value == value_of(value[1]) for value in out)
    assert items == sorted(items) and len(items) >= len(ITEMS) - 1
    assert node.stats()["interrupted_reads"] == 1 and reader.resets == 1
    node.close()


def test_state_resumes_after_the_last_item_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = KeyedReader({})
    node, _, _ = make(ITEMS, reader, monkeypatch, stored=ITEMS, prefetch=16,
                      snapshot_frequency=8)
    assert drain(node, 37) == [value_of(i) for i in range(37)]
    state = node.get_state()
    node.close()
    again, _, calls = make(ITEMS, KeyedReader({}), monkeypatch, stored=ITEMS, prefetch=16)
    again.reset(state)
    assert take(again) == [value_of(i) for i in ITEMS[37:]]
    assert calls == []
    again.close()


def test_workers_compute_misses_as_soon_as_read_ahead_finds_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reader = KeyedReader({}, auto=True)
    node, _, calls = make(ITEMS[:60], reader, monkeypatch, prefetch=16, num_workers=2)
    assert drain(node) == [value_of(i) for i in ITEMS[:60]]
    stats = node.stats()
    assert stats["computed_ahead"] == stats["misses"] == 60
    assert sorted(calls) == ITEMS[:60]
    node.close()
