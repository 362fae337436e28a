"""``get_or_compute`` (and so ``@cached``) under concurrency, on real servers: every caller
gets an object of its own, made before any of them resumes, and a burst computes once --
also when a read was in flight while the computing caller's write landed."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import asynccache as ac

pytestmark = pytest.mark.anyio

CALLERS = 200
TRIALS = 20


def _url(kind: str, request: pytest.FixtureRequest, namespace: str) -> ac.BaseClient:
    if kind == "memory":
        return ac.connect(f"memory://{namespace}")
    if kind == "tiered":
        far = request.getfixturevalue("redis_server").url
        return ac.Tiered(ac.connect(f"memory://near-{namespace}"), ac.connect(far))
    return ac.connect(request.getfixturevalue(f"{kind}_server").url)


@pytest.mark.parametrize("l1", [None, 1 << 20], ids=["no-l1", "l1"])
@pytest.mark.parametrize("kind", ["memory", "redis", "memcached", "tiered"])
async def test_a_waiter_never_sees_the_first_callers_change(
        kind: str, l1: int | None, request: pytest.FixtureRequest, namespace: str) -> None:
    async with ac.AsyncKVCache(_url(kind, request, namespace), namespace=namespace,
                               l1_bytes=l1) as cache:
        seen: list[list[str]] = []

        async def compute() -> dict[str, list[str]]:
            await asyncio.sleep(0.02)
            return {"tags": []}

        async def caller(first: bool) -> None:
            value = await cache.get_or_compute("k", compute)
            if first:
                value["tags"].append("changed")  # in place, before the others look
            await asyncio.sleep(0)
            seen.append(value["tags"])

        await asyncio.gather(*[caller(i == 0) for i in range(8)])
        assert sorted(map(len, seen)) == [0] * 7 + [1]
        assert (await cache.get("k"))["tags"] == []


@contextlib.contextmanager
def one_core_busy() -> Iterator[None]:
    """A process spinning on one core for the test's length (a loaded box)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["redis", "memcached"])
async def test_a_stampede_computes_once(kind: str, request: pytest.FixtureRequest,
                                        namespace: str) -> None:
    computes: list[int] = []
    async with ac.AsyncKVCache(_url(kind, request, namespace), namespace=namespace) as cache:
        with one_core_busy():
            for trial in range(TRIALS):
                async def compute(trial: int = trial) -> dict[str, int]:
                    computes.append(trial)
                    await asyncio.sleep(0.05)
                    return {"trial": trial}

                async def caller(i: int, trial: int = trial, compute: Any = compute) -> Any:
                    await asyncio.sleep((i % 20) * 0.005)  # arrivals spread over 100 ms
                    return await cache.get_or_compute(f"hot-{trial}", compute, ttl=60)

                got = await asyncio.gather(*[caller(i) for i in range(CALLERS)])
                assert all(g == {"trial": trial} for g in got)
    per_trial = [computes.count(t) for t in range(TRIALS)]
    assert per_trial == [1] * TRIALS


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["redis", "memcached"])
async def test_a_stampede_across_processes_computes_once_with_leases(
        kind: str, request: pytest.FixtureRequest, namespace: str) -> None:
    """Two caches with connections of their own (as two processes have) and ``lease=``."""
    computes: list[int] = []
    url = request.getfixturevalue(f"{kind}_server").url
    a = ac.AsyncKVCache(ac.connect(url), namespace=namespace, lease=5)
    b = ac.AsyncKVCache(ac.connect(url), namespace=namespace, lease=5)
    async with a, b:
        for trial in range(TRIALS // 4):
            async def compute(trial: int = trial) -> int:
                computes.append(trial)
                await asyncio.sleep(0.05)
                return trial

            async def caller(i: int, trial: int = trial, compute: Any = compute) -> Any:
                await asyncio.sleep((i % 20) * 0.005)
                return await (a if i % 2 else b).get_or_compute(f"hot-{trial}", compute)

            assert set(await asyncio.gather(*[caller(i) for i in range(CALLERS)])) == {trial}
    assert [computes.count(t) for t in range(TRIALS // 4)] == [1] * (TRIALS // 4)
