"""The Coalescer (`asynccache.cache.coalesce`) against a scripted read: the ``get()``
calls of one loop tick become one read of their distinct keys, and every waiter is
resolved on every path -- values, misses, failures, a read that raises or is cancelled,
a waiter that left -- each caller with an object of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import pytest

from asynccache.cache.coalesce import Coalescer
from asynccache.cache.markers import MISSING, Failed
from asynccache.errors import CacheError, DecodeError, StoreError
from asynccache.observe.stats import Counters


class ScriptedRead:
    """Answers each read from ``answer(keys)``; records the reads; may wait on a gate."""

    def __init__(self, answer: Callable[[Sequence[bytes]], list[Any]]) -> None:
        self.answer = answer
        self.reads: list[list[bytes]] = []
        self.gate: asyncio.Event | None = None

    async def __call__(self, keys: Sequence[bytes]) -> list[Any]:
        self.reads.append(list(keys))
        if self.gate is not None:
            await self.gate.wait()
        return self.answer(keys)


def copy_of(key: bytes, value: Any) -> Any:
    if value == "uncopyable":
        raise DecodeError("cannot copy")
    return list(value) if isinstance(value, list) else value


def run(test: Callable[[Coalescer, ScriptedRead, Counters], Coroutine[Any, Any, None]],
        answer: Callable[[Sequence[bytes]], list[Any]]) -> None:
    async def main() -> None:
        tasks: set[asyncio.Task[Any]] = set()

        def spawn(coro: Awaitable[Any]) -> asyncio.Task[Any]:
            task = asyncio.ensure_future(coro)
            tasks.add(task)
            return task

        read, counters = ScriptedRead(answer), Counters()
        gets = Coalescer(asyncio.get_running_loop(), read, copy_of, counters, spawn)
        await test(gets, read, counters)
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def values(keys: Sequence[bytes]) -> list[Any]:
    return [[k.decode()] for k in keys]  # a list: a value a caller can change in place


def test_one_tick_is_one_read_of_distinct_keys_and_each_caller_owns_its_object() -> None:
    async def test(gets: Coalescer, read: ScriptedRead, counters: Counters) -> None:
        a1, b, a2 = gets.get(b"a"), gets.get(b"b"), gets.get(b"a")
        got = await asyncio.gather(a1, b, a2)
        assert read.reads == [[b"a", b"b"]]
        assert got == [["a"], ["b"], ["a"]]
        assert got[0] is not got[2]  # the second caller of a key gets a copy
        assert counters.snapshot()["coalesced"] == 1

    run(test, values)


def test_the_next_tick_is_another_read() -> None:
    async def test(gets: Coalescer, read: ScriptedRead, counters: Counters) -> None:
        await gets.get(b"a")
        await gets.get(b"a")
        assert read.reads == [[b"a"], [b"a"]]

    run(test, values)


def test_a_miss_is_a_miss_for_every_caller() -> None:
    async def test(gets: Coalescer, read: ScriptedRead, counters: Counters) -> None:
        assert await asyncio.gather(gets.get(b"x"), gets.get(b"x")) == [MISSING, MISSING]

    run(test, lambda keys: [MISSING] * len(keys))


def test_a_failed_key_raises_for_its_callers_only() -> None:
    error = StoreError("node down")

    def answer(keys: Sequence[bytes]) -> list[Any]:
        return [Failed(error) if k == b"bad" else [k.decode()] for k in keys]

    async def test(gets: Coalescer, read: ScriptedRead, counters: Counters) -> None:
        bad1, good, bad2 = gets.get(b"bad"), gets.get(b"good"), gets.get(b"bad")
        results = await asyncio.gather(bad1, good, bad2, return_exceptions=True)
        assert results == [error, ["good"], error]

    run(test, answer)


def test_a_read_that_raises_fails_every_waiter_with_its_error() -> None:
    def answer(keys: Sequence[bytes]) -> list[Any]:
        raise StoreError("the read broke")

    async def test(gets: Coalescer, read: ScriptedRead, counters: Counters) -> None:
        results = await asyncio.gather(gets.get(b"a"), gets.get(b"b"), return_exceptions=True)
        assert [str(r) for r in results] == ["the read broke"] * 2

    run(test, answer)


def test_a_cancelled_read_resolves_every_waiter_with_a_cache_error() -> None:
    async def test(gets: Coalescer, read: ScriptedRead, counters: Counters) -> None:
        read.gate = asyncio.Event()  # the read waits: cancel it there
        a, b = gets.get(b"a"), gets.get(b"b")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        [task] = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        task.cancel()
        for waiter in (a, b):
            with pytest.raises(CacheError, match="cache read was cancelled"):
                await waiter

    run(test, values)


def test_a_waiter_that_left_does_not_keep_the_others_from_their_values() -> None:
    async def test(gets: Coalescer, read: ScriptedRead, counters: Counters) -> None:
        read.gate = asyncio.Event()
        left, stays = gets.get(b"a"), gets.get(b"a")
        await asyncio.sleep(0)
        left.cancel()
        read.gate.set()
        assert await stays == ["a"]  # the first value goes to the first caller still there

    run(test, values)


def test_a_copy_that_fails_is_that_caller_s_error() -> None:
    async def test(gets: Coalescer, read: ScriptedRead, counters: Counters) -> None:
        first, second = gets.get(b"k"), gets.get(b"k")
        assert await first == "uncopyable"  # the first caller takes the object itself
        with pytest.raises(DecodeError, match="cannot copy"):
            await second

    run(test, lambda keys: ["uncopyable"] * len(keys))
