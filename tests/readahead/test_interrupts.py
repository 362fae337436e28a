"""An exception raised at any moment inside a read (a signal handler's, Ctrl-C) leaves the
pipe and the node working: the exception reaches the caller unchanged, never a
`StopIteration` or a store error, and the next reads return the right values within the
normal timeout.

How a trial works: a timer raises ``Interrupted`` (from a ``SIGALRM`` handler) or
``KeyboardInterrupt`` (``SIGINT``, the default handler) at a random moment while the main
thread reads in a loop; the loop is interrupted somewhere inside a read, at a bytecode
nobody chose. Then the next reads of the same pipe are checked, value by value, each
bounded by ``BOUND`` seconds (a read that hangs fails the test through ``SIGALRM``
instead of blocking CI). Seeded: a failure names its seed.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import asynccache as ac

pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX timers"),
    # an interrupt between making a coroutine and handing it to the loop leaves it never
    # awaited: Python says so when it is collected, truthfully and harmlessly
    pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

N = 600
#: a read after an interrupt must return within this (timeout=2 s stores, a compute of
#: microseconds): far above a normal read, far below a hang
BOUND = 30.0


class Interrupted(Exception):
    """What the test's signal handler raises (as a framework's SIGTERM handler would)."""


class Hung(BaseException):
    """A read after the interrupt did not return within BOUND seconds."""


def value_of(index: int) -> tuple[str, int, bytes]:
    return ("item", index, pickle.dumps(index) * 50)


class Source:
    """The dataset: a value every read can check (``value_of(i)``)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[str, int, bytes]:
        return value_of(index)


@contextlib.contextmanager
def raising_handler() -> Iterator[None]:
    """SIGALRM raises ``Interrupted``; SIGINT raises ``KeyboardInterrupt`` as Python's
    default handler does. Each records that it ran (``HANDLED``): a signal still pending
    (the main thread blocked in a call that the signal did not interrupt) is told apart
    from one whose exception CPython dropped."""

    def alarm(signum: int, frame: Any) -> None:
        HANDLED.append(signum)
        raise Interrupted(f"signal {signum}")

    def sigint(signum: int, frame: Any) -> None:
        HANDLED.append(signum)
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGALRM, alarm), signal.signal(signal.SIGINT, sigint)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


#: signals the test's handlers ran for, in order
HANDLED: list[int] = []


def _to_main_thread(signum: int) -> None:
    """Send ``signum`` to the main thread itself, as a terminal's Ctrl-C reaches a
    program waiting in a system call (``raise_signal`` from another thread would deliver
    it to that thread, and the main thread would only see it once its call returns)."""
    signal.pthread_kill(threading.main_thread().ident or 0, signum)


def interrupt_once(read: Callable[[int], Any], rng: random.Random, kind: str,
                   delay: float | None = None, checked: bool = True) -> BaseException:
    """Read in a loop until the interrupt lands; return what was raised. ``checked``:
    each ``read(i)`` must return ``value_of(i)`` (else ``read`` checks what it got)."""
    delay = rng.uniform(0.0002, 0.02) if delay is None else delay
    timer: threading.Timer | None = None
    if kind == "alarm":
        signal.setitimer(signal.ITIMER_REAL, delay)
    else:
        timer = threading.Timer(delay, _to_main_thread, (signal.SIGINT,))
        timer.start()
    i = rng.randrange(N)
    # CPython loses a signal handler's exception raised inside a weakref callback or a
    # __del__ that the garbage collector runs ("Exception ignored in ..."): then the
    # signal is sent again, a few times at most. Reads that turn an interrupt into a
    # store error are caught by the errors == 0 checks instead.
    HANDLED.clear()
    again, lost, given_up = time.monotonic() + delay + 2, 0, time.monotonic() + delay + BOUND
    try:
        try:
            while True:
                now = time.monotonic()
                assert now < given_up, "the interrupt never came"
                if now > again and HANDLED:  # the handler ran, its exception was dropped
                    lost += 1
                    assert lost <= 3, "the interrupt was lost 3 times"
                    HANDLED.clear()
                    if timer is None:
                        signal.setitimer(signal.ITIMER_REAL, delay)
                    else:
                        signal.raise_signal(signal.SIGINT)
                    again = time.monotonic() + delay + 2
                got = read(i)
                assert not checked or got == value_of(i), f"index {i}: {got!r:.60}"
                i = (i + 1) % N if rng.random() < 0.9 else rng.randrange(N)
        except (Interrupted, KeyboardInterrupt) as exc:
            return exc
    finally:
        if timer is not None:
            _join_quietly(timer)


def _join_quietly(timer: threading.Timer) -> None:
    """Wait until the timer's SIGINT was handled (the loop may have ended by another
    exception first: that one, the failure, must be what the test reports), so that no
    KeyboardInterrupt is left pending for whatever runs next."""
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        try:
            timer.join()
            if signal.SIGINT in HANDLED:
                return
            time.sleep(0.01)
        except KeyboardInterrupt:
            continue


def check_bounded(read: Callable[[int], Any], rng: random.Random, reads: int = 40) -> None:
    """The next reads are right and return within BOUND each."""

    def hung(signum: int, frame: Any) -> None:
        raise Hung(f"a read did not return within {BOUND}s after an interrupt")

    previous = signal.signal(signal.SIGALRM, hung)
    try:
        start = rng.randrange(N)
        for n in range(reads):
            index = (start + n) % N if n < reads // 2 else rng.randrange(N)
            signal.setitimer(signal.ITIMER_REAL, BOUND)
            got = read(index)
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert got == value_of(index), f"index {index}: {got!r:.60}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


STORES = ["redis", "memcached", "lmdb", "tiered", "cluster"]

#: Real KeyboardInterrupts (SIGINT sent to the main thread): opt in with ``-m soak``. With
#: one core kept busy, one run in a few let a KeyboardInterrupt surface after its trial
#: had ended (not yet understood: the test harness, not the pipe, is the suspect), which
#: aborts the whole pytest session; the SIGALRM variant (an exception raised by a signal
#: handler, the same code paths) runs in every CI run.
SIGINT = pytest.param("sigint", marks=pytest.mark.soak)


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ac.BaseClient[Any]]:
    kind = request.param
    if kind == "redis":
        url = request.getfixturevalue("redis_server").url
        return lambda: ac.connect(url, timeout=2)
    if kind == "memcached":
        url = request.getfixturevalue("memcached_server").url
        return lambda: ac.connect(url, timeout=2)
    if kind == "cluster":
        url = request.getfixturevalue("redis_cluster").url
        return lambda: ac.connect(url, timeout=2)
    if kind == "lmdb":
        return lambda: ac.connect(f"lmdb://{tmp_path}/lmdb")
    far = request.getfixturevalue("redis_server").url
    return lambda: ac.Tiered(ac.connect(f"lmdb://{tmp_path}/near"), ac.connect(far, timeout=2))


@pytest.mark.parametrize("prefetch", [64, 0])
@pytest.mark.parametrize("kind", ["alarm", SIGINT])
def test_an_interrupt_inside_dp_i_leaves_the_pipe_working(
        store: Callable[[], ac.BaseClient[Any]], namespace: str, prefetch: int,
        kind: str) -> None:
    rng = random.Random(f"{namespace}-{prefetch}-{kind}")
    trials = 60 if kind == "alarm" else 25
    with ac.AsyncKVCacheMapDataPipe(Source(), store(), prefetch=prefetch,
                                    namespace=namespace) as dp:
        for i in range(0, N, 2):  # half the values cached, half computed on read
            assert dp[i] == value_of(i)
        dp.flush()
        with raising_handler():
            for trial in range(trials):
                raised = interrupt_once(dp.__getitem__, rng, kind)
                expected = Interrupted if kind == "alarm" else KeyboardInterrupt
                assert type(raised) is expected, f"trial {trial}: {raised!r}"
                check_bounded(dp.__getitem__, rng)
        stats = dp.stats()
        assert stats["errors"] == 0, stats  # no interrupt was taken for a store failure
        assert stats["interrupted_reads"] > 0, stats


@pytest.mark.parametrize("kind", ["alarm", SIGINT])
def test_an_interrupt_inside_getitems_leaves_the_pipe_working(
        store: Callable[[], ac.BaseClient[Any]], namespace: str, kind: str) -> None:
    rng = random.Random(f"{namespace}-{kind}")

    with ac.AsyncKVCacheMapDataPipe(Source(), store(), prefetch=64, namespace=namespace) as dp:
        order = list(range(N))
        rng.shuffle(order)
        dp.set_order([order[i:i + 16] for i in range(0, N, 16)])

        def read(i: int) -> Any:
            batch = [(i + k) % N for k in range(16)]
            values = dp.__getitems__(batch)
            assert values == [value_of(b) for b in batch]
            return value_of(i)

        with raising_handler():
            for _trial in range(25):
                raised = interrupt_once(read, rng, kind)
                assert isinstance(raised, (Interrupted, KeyboardInterrupt)), raised
                check_bounded(read, rng, reads=10)
        assert dp.stats()["errors"] == 0, dp.stats()


def test_no_short_list_after_interrupts(redis_server: Any, namespace: str) -> None:
    """``list(map(dp.__getitem__, idx))`` never ends early: a StopIteration that escaped
    a read would stop ``map`` silently, and the caller would get a short list."""
    rng = random.Random(namespace)
    with ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url, timeout=2),
                                    prefetch=64, namespace=namespace) as dp, raising_handler():
        for _trial in range(30):
            interrupt_once(dp.__getitem__, rng, "alarm")
            wanted = [rng.randrange(N) for _ in range(300)]
            got = list(map(dp.__getitem__, wanted))
            assert got == [value_of(i) for i in wanted]


def test_other_threads_read_right_while_the_main_thread_is_interrupted(
        redis_server: Any, namespace: str) -> None:
    rng = random.Random(namespace)
    wrong: list[str] = []
    stop = threading.Event()
    with ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url, timeout=2),
                                    prefetch=64, namespace=namespace) as dp:

        def reader(seed: int) -> None:
            local = random.Random(seed)
            while not stop.is_set():
                i = local.randrange(N)
                got = dp[i]
                if got != value_of(i):
                    wrong.append(f"{i}: {got!r:.40}")

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        try:
            with raising_handler():
                for _trial in range(40):
                    interrupt_once(dp.__getitem__, rng, "alarm")
                    check_bounded(dp.__getitem__, rng, reads=10)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert wrong == []


@pytest.mark.parametrize("backend", ["redis", "memcached"])
def test_an_interrupt_inside_the_node_leaves_it_working(
        request: pytest.FixtureRequest, backend: str, namespace: str) -> None:
    pytest.importorskip("torchdata.nodes")
    from torchdata.nodes import IterableWrapper

    from asynccache.nodes import CachedMapper

    url = request.getfixturevalue(f"{backend}_server").url
    rng = random.Random(namespace)
    node = CachedMapper(IterableWrapper(range(N)), value_of, ac.connect(url, timeout=2),
                        prefetch=64, namespace=namespace)
    state = {"expected": 0, "resetting": True}

    def restart() -> None:  # an interrupt inside it: done again before the next read
        state["resetting"] = True
        node.reset()
        state["expected"] = 0
        state["resetting"] = False

    def read_one() -> None:
        if state["resetting"]:
            restart()
        try:
            got = node.next()
        except StopIteration:
            restart()
            return
        # an interrupt may cost the item being pulled at that moment, never give
        # another item's value or go back
        assert got == value_of(got[1]) and got[1] >= state["expected"], got[:2]
        state["expected"] = got[1] + 1

    try:
        with raising_handler():
            for _trial in range(40):
                raised = interrupt_once(lambda _i: read_one(), rng, "alarm",
                                        rng.uniform(0.0002, 0.01), checked=False)
                assert type(raised) is Interrupted, raised
                for _ in range(10):
                    signal.setitimer(signal.ITIMER_REAL, BOUND)
                    read_one()
                    signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        node.close()


def test_a_timed_out_call_is_not_left_running(redis_server: Any, namespace: str) -> None:
    """LoopThread.call interrupted: the coroutine it started is cancelled, so nothing of
    the interrupted call finishes behind the caller's back."""
    from asynccache.store.loop import get_loop_thread

    loop = get_loop_thread()
    finished: list[bool] = []

    async def slow() -> None:
        await __import__("asyncio").sleep(0.3)
        finished.append(True)

    with raising_handler():
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted):
            loop.call(slow(), 5)
    time.sleep(0.6)
    assert finished == []


def test_an_interrupted_main_process_with_live_workers_goes_on(
        redis_server: Any, namespace: str) -> None:
    """The main process is interrupted while two DataLoader workers read the pipe: the
    next pass (new workers, or the same pipe read in the main process) is right."""
    torch_data = pytest.importorskip("torch.utils.data")
    rng = random.Random(namespace)
    with ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url, timeout=2),
                                    prefetch=64, namespace=namespace) as dp:
        loader = torch_data.DataLoader(dp, batch_size=16, num_workers=2,
                                       collate_fn=lambda batch: batch)
        dp.set_order(loader.batch_sampler)
        with raising_handler():
            for _trial in range(4):
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.05, 0.6))
                with contextlib.suppress(Interrupted):
                    for batch in loader:
                        assert all(v == value_of(v[1]) for v in batch)
                signal.setitimer(signal.ITIMER_REAL, 0)
            signal.setitimer(signal.ITIMER_REAL, BOUND * 2)  # a whole epoch, bounded
            seen = [v for batch in loader for v in batch]
            signal.setitimer(signal.ITIMER_REAL, 0)
        assert sorted(v[1] for v in seen) == list(range(N))
        assert all(v == value_of(v[1]) for v in seen)
        check_bounded(dp.__getitem__, rng)
