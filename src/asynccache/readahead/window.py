"""How much read-ahead: a window (in flight + ready) and requests, in items, sized by the
bytes replies carry. The one sizing rule of the pipe's prefetcher and the torchdata node.
"""

from __future__ import annotations

import collections
import itertools
import operator
import weakref

from ..cache.port import MISSING, NOT_READ
from ..errors import ConfigError
from .readers import Ticket

__all__ = [
    "BOUNDED_REQUEST_BYTES",
    "DEFAULT_READAHEAD_BYTES",
    "FIRST_BATCH",
    "FIRST_WINDOW",
    "GROWN_SAMPLE",
    "SMALL_WINDOW_BYTES",
    "WINDOW_GROWTH",
    "Budget",
    "WindowSizer",
    "batch_size_for",
    "full_window",
    "learned",
    "readahead_budget",
    "sized_window",
    "small_item_bytes",
    "values_found",
]

#: Smallest and largest read-ahead request, in keys. Each request costs ~60–90 µs of
#: client CPU whatever its size, so batches are as large as the window allows.
MIN_BATCH = 16
MAX_BATCH = 256


#: Read-ahead is bounded in bytes as well as in items, by the sizes the replies showed:
#: ``prefetch=64`` of 4 MiB values would otherwise be two 128 MiB requests, whose first
#: value is usable only once the whole reply is in, and 256 MiB in flight per consumer.
#: The window (in flight + ready) holds about ``prefetch_bytes``; one request carries
#: about ``prefetch_bytes / REQUESTS_PER_WINDOW`` (at least one value: a single 50 MiB
#: value is still read, alone).
DEFAULT_READAHEAD_BYTES = 32 << 20
REQUESTS_PER_WINDOW = 32
#: Until a reply has shown how large values are, the window starts this small, in
#: requests this small (a few extra round trips once per consumer thread, instead of
#: 2 × 32 values of unknown size, and a first value behind at most 3 others). The
#: budget holds from the first reply on (values of unknown size cannot be bounded).
FIRST_WINDOW = 16
FIRST_BATCH = 4
#: From this many bytes per request on, a read that waits parses and decodes no further
#: than the request it waits for (a window that arrived meanwhile is tens of MiB); below
#: it, taking every reply that arrived at once costs fewer system calls.
BOUNDED_REQUEST_BYTES = 256 << 10
#: weight of the newest reply in the bytes-per-item estimate
_ALPHA = 0.25
#: Small values: the window grows past ``prefetch`` items, up to ``WINDOW_GROWTH`` times
#: it, while it holds at most ``SMALL_WINDOW_BYTES``. A request costs ~60–90 µs of client
#: CPU whatever its size and 64 items of 100 B are 6 KiB: at ``prefetch=64`` two requests
#: of 32 leave the consumer waiting on round trips. What such a window reads in vain when
#: the order changes is at most this many bytes, so the growth costs nothing that
#: ``prefetch`` exists to bound.
SMALL_WINDOW_BYTES = 1 << 20
WINDOW_GROWTH = 4
#: a grown window checks the size of the values found in one reply in this many
GROWN_SAMPLE = 8
#: The window also covers the store's distance. Measured, not computed: the sizes' rule
#: above knows nothing of a store 2 ms away (read at 100,000 items/s, 200 items must be
#: in flight), and a round trip seen from the consumer includes the time it spent
#: elsewhere. So every ``RATE_PERIOD`` the window's part beyond that rule (``extra``)
#: grows by ``GROW`` (at least a request) while the consumer spent ``WAITED_SHARE`` of
#: the period waiting for read-ahead in flight and its rate grew since the last growth
#: (more in flight helped: distance); it holds while the consumer waits but the rate
#: does not grow (the store or the link is the limit, not the window), and shrinks by
#: ``SHRINK`` while the consumer never waits and most of the window sits ready (the
#: consumer is the slower side).
RATE_PERIOD = 0.02
GROW = 2.0
SHRINK = 0.9
#: a rate this much higher than at the last growth counts as grown
RATE_GAIN = 1.25
#: the consumer "waited" in a period when waits for read-ahead took this share of it (a
#: few short waits are the machine's noise -- a busy core -- not the store's distance)
WAITED_SHARE = 0.2
#: the largest window in items, whatever the rate and the distance
MAX_WINDOW = 8192


def batch_size_for(window: int) -> int:
    """Keys per read-ahead request for a window: two requests in flight when possible."""
    if window <= 0:
        return 0
    return max(min(window, MIN_BATCH), min(MAX_BATCH, window // 2))


def learned(item_bytes: float, nbytes: int, items: int) -> float:
    """The bytes-per-item estimate after a reply of ``nbytes`` for ``items`` keys (a
    moving average; a reply without bytes -- all misses -- teaches nothing)."""
    if not nbytes or not items:
        return item_bytes
    per_item = nbytes / items
    return per_item if item_bytes <= 0 else item_bytes + _ALPHA * (per_item - item_bytes)


def full_window(prefetch: int, growth: int = WINDOW_GROWTH) -> int:
    """The largest window in items: ``prefetch`` grown for the smallest values (0: off)."""
    return max(0, prefetch) * growth


def small_item_bytes(prefetch: int, prefetch_bytes: int, growth: int = WINDOW_GROWTH) -> float:
    """Bytes per item below which sizes change nothing: the full (grown) window and its
    requests fit the byte bounds, so replies of such items need not be looked at."""
    window = full_window(prefetch, growth)
    full = batch_size_for(window)
    if not full:
        return 0.0
    return min(min(SMALL_WINDOW_BYTES, prefetch_bytes) / window,
               max(1, prefetch_bytes // REQUESTS_PER_WINDOW) / full)


def sized_window(prefetch: int, prefetch_bytes: int, item_bytes: float,
                 growth: int = WINDOW_GROWTH, value_bytes: float = 0.0,
                 high_bytes: float = 0.0) -> tuple[int, int]:
    """(window, batch) in items for ``prefetch`` items of ``item_bytes`` on average,
    bounded by ``prefetch_bytes`` (and grown past ``prefetch``, up to ``growth`` times
    it, while the window would hold at most ``SMALL_WINDOW_BYTES`` if every item were a
    value of ``value_bytes``: the size of the values found, which misses do not dilute,
    so a cold epoch of large values does not grow a window the warm one then fills);
    the bytes bound counts each item at ``high_bytes`` when larger (the largest per-item
    size of recent replies: a mix of sizes is bounded by its large values);
    ``item_bytes <= 0``: nothing known, items only."""
    window = prefetch
    if item_bytes > 0 and prefetch > 0:
        window = max(1, min(prefetch, int(prefetch_bytes // max(item_bytes, high_bytes))))
        if window == prefetch and growth > 1:
            per_value = max(item_bytes, value_bytes)
            small = int(min(SMALL_WINDOW_BYTES, prefetch_bytes) // per_value)
            window = max(window, min(full_window(prefetch, growth), small))
    batch = batch_size_for(window)
    if item_bytes > 0 and batch > 0:
        per_request = max(1, prefetch_bytes // REQUESTS_PER_WINDOW)
        batch = max(1, min(batch, int(per_request // item_bytes)))
    return window, batch


def values_found(ticket: Ticket) -> int:
    """How many of a completed ticket's values are values (not misses, not unread).
    By identity: ``list.count`` would compare arrays and tensors with ``==``."""
    values = ticket.values
    missing = list(map(operator.is_, values, itertools.repeat(MISSING))).count(True)
    if ticket.partial:
        missing += list(map(operator.is_, values, itertools.repeat(NOT_READ))).count(True)
    return len(values) - missing


#: the window's bound in bytes follows the largest value of this many recent replies,
#: not their average: a mix of 1 KiB and 4 MiB values averages 2 MiB, and a window of
#: 2 MiB items may hold twice its budget when it happens to hold 4 MiB ones
HIGH_SAMPLES = 32


def readahead_budget(readahead_bytes: int | None, prefetch_bytes: int | None) -> int:
    """The ``readahead_bytes=`` of a pipe or node, checked (``prefetch_bytes=`` is its
    former name, still accepted)."""
    if readahead_bytes is not None and prefetch_bytes is not None:
        raise ConfigError("give readahead_bytes= only (prefetch_bytes= is its former name)")
    value = readahead_bytes if readahead_bytes is not None else prefetch_bytes
    if value is None:
        return DEFAULT_READAHEAD_BYTES
    if type(value) is not int or value <= 0:
        raise ConfigError(f"readahead_bytes must be an int > 0 (bytes of read-ahead per "
                          f"process, e.g. 64 << 20), got {value!r}")
    return value


class Budget:
    """The read-ahead's memory budget of one pipe or node in one process
    (``readahead_bytes``), shared evenly by the windows reading it at once (one per
    consumer thread; a window whose thread ended leaves the count by itself)."""

    __slots__ = ("nbytes", "windows")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.windows: weakref.WeakSet[WindowSizer] = weakref.WeakSet()

    def share(self) -> int:
        return max(1, self.nbytes // max(1, len(self.windows)))

    def __reduce__(self) -> tuple[type[Budget], tuple[int]]:
        """A copy (a deep-copied or pickled node) is a budget of its own, not yet
        shared: the windows reading it are this process's objects."""
        return Budget, (self.nbytes,)


class WindowSizer:
    """A read-ahead window and its requests, in items, sized by the bytes replies carry.

    The one sizing rule of the pipe's `Prefetcher` and the torchdata node: a first
    window of ``FIRST_WINDOW`` in requests of ``FIRST_BATCH`` until a reply shows sizes,
    then `sized_window()` of two moving averages, bytes per item of the current mix
    (what an item costs in flight) and bytes per value found (what the small-value growth
    follows). Replies that cannot change anything are not looked at: small values once
    the window is full, except one reply in ``GROWN_SAMPLE`` to a grown window.
    """

    __slots__ = (
        "__weakref__",
        "_base",
        "_full_batch",
        "_full_window",
        "_grown_rate",
        "_highs",
        "_period_at",
        "_period_taken",
        "_period_waited",
        "_small_item",
        "batch",
        "budget",
        "extra",
        "growth",
        "high_bytes",
        "item_bytes",
        "prefetch",
        "rate",
        "samples",
        "value_bytes",
        "window",
    )

    def __init__(self, prefetch: int, budget: int | Budget,
                 growth: int = WINDOW_GROWTH) -> None:
        self.prefetch = max(0, prefetch)
        #: the bytes bound: this window's share of its pipe's or node's budget
        self.budget = budget if isinstance(budget, Budget) else Budget(budget)
        self.budget.windows.add(self)
        prefetch_bytes = self.budget.share()
        self.growth = growth
        #: bytes per item the replies carried (moving average; misses count as 0 bytes,
        #: so it is what an item costs in flight for the current mix); 0: not known yet
        self.item_bytes = 0.0
        #: bytes per value found (misses not counted): what sizes the small-value growth
        self.value_bytes = 0.0
        #: the largest value of the last HIGH_SAMPLES replies: what the bytes bound
        #: counts each item as (a reader that cannot tell: the reply's mean)
        self.high_bytes = 0.0
        self._highs: collections.deque[float] = collections.deque(maxlen=HIGH_SAMPLES)
        self.samples = 0  # replies to a grown window
        self.window = min(self.prefetch, FIRST_WINDOW)
        self.batch = min(batch_size_for(self.window), FIRST_BATCH)
        self._small_item = small_item_bytes(self.prefetch, prefetch_bytes, growth)
        self._full_window = full_window(self.prefetch, growth)
        self._full_batch = batch_size_for(self._full_window)
        #: (window, batch) by sizes alone; the window may be larger for the distance
        self._base = (self.window, self.batch)
        #: items beyond the sizes' rule, for the store's distance (see RATE_PERIOD)
        self.extra = 0
        #: the consumer's rate in items/s over the last period; at the last growth
        self.rate = self._grown_rate = 0.0
        self._period_at = 0.0
        self._period_taken = self._period_waited = 0

    def learn(self, ticket: Ticket) -> bool:
        """Take a completed reply's sizes into account; True if it was looked at (the
        window and batch may have changed)."""
        nbytes = ticket.nbytes
        if not (self.batch < self._full_batch or self.window < self._full_window
                or nbytes > self._small_item * len(ticket.indices)
                or (nbytes and self.window > self.prefetch and self._sampled(ticket))):
            return False
        if not ticket.indices or ticket.abandoned:
            return False
        # A reply without bytes (all misses, a cold epoch) teaches nothing about sizes:
        # it only ends the small first window when no size is known yet.
        self.item_bytes = learned(self.item_bytes, nbytes, len(ticket.indices))
        if nbytes:
            self.value_bytes = learned(self.value_bytes, nbytes, values_found(ticket))
            self._highs.append(ticket.largest or nbytes / len(ticket.indices))
            self.high_bytes = max(self._highs)
        base = sized_window(self.prefetch, self.prefetch_bytes, self.item_bytes,
                            self.growth, self.value_bytes, self.high_bytes)
        if base[0] > self._base[0]:
            # the sizes' rule grew the window: a faster consumer after it is not the
            # distance's doing (the first reply of a thread ends its 16-item window)
            self._grown_rate = float("inf")
        self._base = base
        self._size()
        return True

    def timed(self, now: float, taken: int, waited_us: int, ready: int) -> bool:
        """At ``now`` a read-ahead request arrived; the consumer has taken ``taken``
        items and waited ``waited_us`` for read-ahead in flight so far, ``ready`` items
        wait for it: once per ``RATE_PERIOD``, grow, hold or shrink the window's part for
        the distance. True if the window or batch changed."""
        elapsed = now - self._period_at
        if elapsed < RATE_PERIOD or not self.prefetch:
            return False
        waited = (waited_us - self._period_waited) > WAITED_SHARE * elapsed * 1e6
        self.rate = (taken - self._period_taken) / elapsed if self._period_at else 0.0
        self._period_at, self._period_taken, self._period_waited = now, taken, waited_us
        extra = self.extra
        if self._grown_rate == float("inf"):
            self._grown_rate = self.rate  # the rate with the new base window, to grow from
        elif waited and self.rate:
            if self.rate > self._grown_rate * RATE_GAIN:
                extra = max(int(extra * GROW), self.batch)
                self._grown_rate = self.rate
        elif extra and ready * 4 > self.window * 3:
            extra = int(extra * SHRINK)
            self._grown_rate = min(self._grown_rate, self.rate)
        if extra == self.extra:
            return False
        self.extra = extra
        before = (self.window, self.batch)
        self._size()
        return (self.window, self.batch) != before

    def _size(self) -> None:
        """The window: the sizes' rule plus the part for the distance, within the bytes
        bound and ``MAX_WINDOW``."""
        window, batch = self._base
        if self.extra:
            per_item = max(self.item_bytes, self.high_bytes)
            bound = (int(self.prefetch_bytes // per_item) if per_item > 0
                     else self._full_window)
            window = max(window, min(window + self.extra, bound, MAX_WINDOW))
        self.window, self.batch = window, batch

    @property
    def prefetch_bytes(self) -> int:
        """This window's share of the budget, now."""
        return self.budget.share()

    def _sampled(self, ticket: Ticket) -> bool:
        """One reply in ``GROWN_SAMPLE`` to a grown window: do its values, misses not
        counted, turn out too large for it? (Counting misses costs ~30 ns an item: not on
        every reply of the small values that grew the window.)"""
        self.samples += 1
        return (not self.samples % GROWN_SAMPLE
                and ticket.nbytes > self._small_item * values_found(ticket))
