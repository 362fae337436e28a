"""The window's part for the store's distance (window.py, RATE_PERIOD): it grows while
the consumer waits for read-ahead and its rate grows, holds while waiting does not
make it faster, shrinks while the consumer is the slower side, and never passes the
bytes bound or MAX_WINDOW. Driven period by period, no I/O, no clock."""

from __future__ import annotations

from asynccache.readahead.readers import Ticket
from asynccache.readahead.window import (
    GROW,
    MAX_WINDOW,
    RATE_PERIOD,
    SHRINK,
    WindowSizer,
)

MIB = 1 << 20


class Consumer:
    """Feeds a sizer one period at a time: ``rate`` items/s taken, whether it waited."""

    def __init__(self, sizer: WindowSizer) -> None:
        self.sizer = sizer
        self.now = 1000.0
        self.taken = self.stalls = 0
        sizer.timed(self.now, 0, 0, 0)  # the first period starts

    def period(self, rate: float, waited: bool, ready: int = 0) -> int:
        self.now += RATE_PERIOD * 1.01
        self.taken += int(rate * RATE_PERIOD * 1.01)
        self.stalls += int(RATE_PERIOD * 1e6 * (0.5 if waited else 0.01))  # µs waited
        self.sizer.timed(self.now, self.taken, self.stalls, ready)
        return self.sizer.window


def sized(value_bytes: int, prefetch: int = 64, budget: int = 32 * MIB) -> WindowSizer:
    sizer = WindowSizer(prefetch, budget)
    ticket = Ticket(list(range(32)), [b"k"] * 32)
    ticket.values = [b"v"] * 32
    ticket.nbytes = 32 * value_bytes
    ticket.done = True
    sizer.learn(ticket)
    return sizer


def test_the_window_grows_while_waiting_makes_the_consumer_faster() -> None:
    sizer = sized(4096)
    base = sizer.window
    consumer = Consumer(sizer)
    windows = [consumer.period(rate=10_000 * 2 ** n, waited=True) for n in range(5)]
    assert windows[0] > base and windows == sorted(windows) and len(set(windows)) == 5
    assert sizer.extra >= sizer.batch * GROW ** 3


def test_it_holds_when_waiting_does_not_make_the_consumer_faster() -> None:
    """The store or the link is the limit: more in flight would be memory for nothing."""
    sizer = sized(4096)
    consumer = Consumer(sizer)
    consumer.period(rate=50_000, waited=True)
    grown = consumer.period(rate=80_000, waited=True)
    assert [consumer.period(rate=80_000, waited=True) for _ in range(10)] == [grown] * 10


def test_it_shrinks_while_the_consumer_is_the_slower_side() -> None:
    sizer = sized(4096)
    consumer = Consumer(sizer)
    for n in range(4):
        consumer.period(rate=10_000 * 2 ** n, waited=True)
    grown = sizer.window
    # no waits, but little ready: the window is just enough, it holds
    assert consumer.period(rate=80_000, waited=False, ready=grown // 4) == grown
    # no waits and most of the window ready: the consumer is slower, it shrinks
    shrunk = consumer.period(rate=5_000, waited=False, ready=grown)
    assert shrunk < grown and sizer.extra <= int((grown - sizer._base[0]) * SHRINK)
    for _ in range(200):
        consumer.period(rate=5_000, waited=False, ready=sizer.window)
    assert sizer.extra == 0 and sizer.window == sizer._base[0]


def test_the_bytes_bound_and_max_window_hold() -> None:
    sizer = sized(MIB, budget=32 * MIB)
    consumer = Consumer(sizer)
    for n in range(20):
        consumer.period(rate=100 * 2 ** n, waited=True)
    assert sizer.window * MIB <= 32 * MIB  # 1 MiB values: 32 items, however far away
    small = sized(64, budget=1 << 30)
    consumer = Consumer(small)
    for n in range(40):
        consumer.period(rate=1000 * 2 ** n, waited=True)
    assert small.window == MAX_WINDOW


def test_prefetch_zero_stays_off() -> None:
    sizer = WindowSizer(0, 32 * MIB)
    consumer = Consumer(sizer)
    assert consumer.period(rate=1000, waited=True) == 0


def test_a_copied_window_has_a_budget_of_its_own() -> None:
    """A deep-copied or pickled node carries its sizer: the budget's set of windows
    (weak references) is not copied, the copy's budget is whole and unshared."""
    import copy
    import pickle

    sizer = sized(4096)
    twin = WindowSizer(64, sizer.budget)  # two windows share one budget
    assert sizer.prefetch_bytes == twin.prefetch_bytes == 16 * MIB
    for copied in (copy.deepcopy(sizer), pickle.loads(pickle.dumps(sizer))):
        assert copied.budget is not sizer.budget and copied.budget.nbytes == 32 * MIB
        assert copied.prefetch_bytes == 32 * MIB and copied.window == sizer.window
