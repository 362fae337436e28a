"""Asyncio cancellation at random moments never changes what later callers get.

A storm of concurrent calls (``get``, ``get_many``, ``get_or_compute`` and the decorator)
over a small key space, a share of them cancelled with ``task.cancel()`` or cut short by
``asyncio.timeout`` at random moments; every call that returns, and every call made after
the storm, returns the value of its key (or a miss), never another key's value or a
half-written one. Seeded by the test's namespace.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

import asynccache as ac

pytestmark = pytest.mark.anyio

KEYS = 64
CALLS = 3_000


def value_of(key: int) -> tuple[str, int, bytes]:
    return ("value", key, bytes([key % 256]) * (key * 37 % 5000))


@pytest.mark.parametrize("backend", ["redis", "memcached"])
async def test_a_cancellation_storm_leaves_every_value_right(
        request: pytest.FixtureRequest, backend: str, namespace: str) -> None:
    url = request.getfixturevalue(f"{backend}_server").url
    rng = random.Random(namespace)
    wrong: list[str] = []
    cancelled = 0
    async with ac.AsyncKVCache(ac.connect(url, timeout=2), namespace=namespace) as cache:

        async def compute(key: int) -> Any:
            await asyncio.sleep(rng.random() * 0.002)
            return value_of(key)

        @cache.cached
        async def decorated(key: int) -> Any:
            return await compute(key)

        def check(key: int, got: Any) -> None:
            if got != value_of(key):
                wrong.append(f"{key}: {got!r:.50}")

        async def one_call(kind: int, key: int, keys: list[int]) -> None:
            if kind == 0:
                got = await cache.get(key, default=None)
                if got is not None:
                    check(key, got)
            elif kind == 1:
                for k, got in (await cache.get_many(keys)).items():
                    check(k, got)
            elif kind == 2:
                check(key, await cache.get_or_compute(key, lambda: compute(key)))
            else:
                check(key, await decorated(key))

        async def call(n: int) -> None:
            kind = rng.randrange(4)
            key = rng.randrange(KEYS)
            keys = rng.sample(range(KEYS), 8)
            if n % 4 == 0:  # cut short by a timeout
                try:
                    async with asyncio.timeout(rng.random() * 0.003):
                        await one_call(kind, key, keys)
                except TimeoutError:
                    pass
            else:
                await one_call(kind, key, keys)

        tasks = []
        for n in range(CALLS):
            tasks.append(asyncio.create_task(call(n)))
            if n % 50 == 49:
                await asyncio.sleep(0)  # let them interleave
                for task in rng.sample(tasks[-50:], 8):
                    cancelled += task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        failures = [o for o in outcomes
                    if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
        assert failures == [], failures[:3]
        assert cancelled > CALLS // 20  # the storm did cancel calls at random moments
        # after the storm: every key reads right, through every path
        await cache.flush()
        for key in range(KEYS):
            check(key, await cache.get_or_compute(key, lambda key=key: compute(key)))
            check(key, await decorated(key))
        for key, got in (await cache.get_many(range(KEYS))).items():
            check(key, got)
    assert wrong == []
