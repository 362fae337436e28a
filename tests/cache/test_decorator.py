"""``@cache.cached`` and ``@cache.cached_many`` on real servers: keys exact over types and
per instance, one computation per burst, own objects, entries under control, and the
example service of the docs. (The behaviours aiocache's and cashews' own decorator tests
check, written anew; where ours differ, docs/async-services.md says why.)"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

import asynccache as ac

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["redis_server", "memcached_server", "redis_cluster"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param).url


async def test_arguments_bind_to_one_key_and_a_burst_computes_once(url: str,
                                                                   namespace: str) -> None:
    calls: list[tuple[int, str]] = []
    async with ac.AsyncKVCache(ac.connect(url), namespace=namespace) as cache:

        @cache.cached(ttl=60)
        async def profile(user_id: int, lang: str = "en", *, limit: int | None = None
                          ) -> dict[str, Any]:
            calls.append((user_id, lang))
            await asyncio.sleep(0.02)
            return {"id": user_id, "lang": lang, "tags": []}

        burst = await asyncio.gather(*[profile(7) for _ in range(20)])
        assert calls == [(7, "en")] and len({id(p) for p in burst}) == 20
        burst[0]["tags"].append("changed")  # in place: no other caller sees it
        assert all(p["tags"] == [] for p in burst[1:])
        # one key whatever the spelling: positional, keyword, the default given
        for same in (profile(7, "en"), profile(user_id=7), profile(7, lang="en", limit=None)):
            assert (await same)["id"] == 7
        assert calls == [(7, "en")]
        assert (await profile(7, "fr"))["lang"] == "fr" and calls[-1] == (7, "fr")
        assert profile.__name__ == "profile" and profile.cache is cache


async def test_key_callable_shared_methods_and_plain_functions(url: str, namespace: str) -> None:
    computed: list[Any] = []
    async with ac.AsyncKVCache(ac.connect(url), namespace=namespace) as cache:

        @cache.cached(key=lambda path, **_options: ("file", path))
        async def load(path: str, verbose: bool = False) -> str:
            computed.append(path)
            return path.upper()

        assert await load("a", verbose=True) == await load("a") == "A"

        class Service:
            @cache.cached(noself=True)  # every instance may share entries
            async def double(self, x: int) -> int:
                computed.append(x)
                return 2 * x

        assert await Service().double(4) == await Service().double(4) == 8

        @cache.cached(ttl=30)
        def square(x: int) -> int:  # a plain function: the wrapper is async
            computed.append(("sq", x))
            return x * x

        assert await square(5) == await square(5) == 25
    assert computed == ["a", 4, ("sq", 5)]


async def test_arguments_the_key_encoding_does_not_cover_say_so(namespace: str) -> None:
    async with ac.AsyncKVCache(ac.connect("memory://decorator"), namespace=namespace) as cache:

        @cache.cached
        async def scale(factor: object) -> object:
            return factor

        with pytest.raises(ac.KeyEncodingError, match=r"argument factor=.*key="):
            await scale(object())
        with pytest.raises(ac.ConfigError, match="ttl"):
            cache.cached(ttl=0)(scale)
        with pytest.raises(ac.ConfigError, match="key="):
            cache.cached(key="name")(scale)  # type: ignore[arg-type]


@pytest.fixture(params=["redis_server", "memcached_server"])
def server_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param).url


async def test_keys_are_exact_over_types(server_url: str, namespace: str) -> None:
    async with ac.AsyncKVCache(ac.connect(server_url), namespace=namespace) as cache:
        calls: list[Any] = []

        @cache.cached
        async def echo(x: Any) -> str:
            calls.append(x)
            return f"{type(x).__name__}:{x!r}"

        seven = [True, 1, 1.0, "1", b"1", (1,), [1]]
        first = [await echo(v) for v in seven]
        again = [await echo(v) for v in seven]
        assert first == again == [f"{type(v).__name__}:{v!r}" for v in seven]
        assert len(calls) == 7
        # accepted now: floats, containers (a dict's order does not matter), long strings
        assert await echo({"a": 1, "b": [2.5]}) == await echo({"b": [2.5], "a": 1})
        long = "x" * 5000
        assert await echo(long) == f"str:{long!r}" and await echo(long) == f"str:{long!r}"
        assert len(calls) == 9


async def test_methods_are_per_instance_or_shared_when_told(server_url: str,
                                                            namespace: str) -> None:
    async with ac.AsyncKVCache(ac.connect(server_url), namespace=namespace) as cache:

        class TenantRepo:
            def __init__(self, tenant: str) -> None:
                self.tenant = tenant

            def __cache_key__(self) -> str:
                return self.tenant

            @cache.cached
            async def name(self, i: int) -> str:
                return f"{self.tenant}-{i}"

        assert await TenantRepo("a").name(1) == "a-1"
        assert await TenantRepo("b").name(1) == "b-1"
        assert await TenantRepo("a").name(1) == "a-1"

        class NoKey:
            @cache.cached
            async def name(self, i: int) -> str:
                return str(i)

        with pytest.raises(ac.MethodKeyError, match=r"__cache_key__.*noself=True"):
            await NoKey().name(1)

        class Base:
            factor = 1

            @cache.cached(noself=True)
            async def val(self, x: int) -> int:
                return x * self.factor

            @classmethod
            @cache.cached
            async def make(cls, x: int) -> str:
                return f"{cls.__name__}-{x}"

        class Sub(Base):
            factor = 100

        assert (await Base().val(2), await Sub().val(2)) == (2, 200)
        assert (await Base.make(2), await Sub.make(2)) == ("Base-2", "Sub-2")


async def test_functions_with_one_qualified_name_never_share(server_url: str,
                                                             namespace: str) -> None:
    async with ac.AsyncKVCache(ac.connect(server_url), namespace=namespace) as cache:

        def power(n: int) -> Any:
            @cache.cached
            async def f(x: int) -> int:
                return int(x**n)
            return f

        square, cube = power(2), power(3)
        assert (await square(3), await cube(3)) == (9, 27)
        sq = cache.cached(lambda x: x * x)
        cu = cache.cached(lambda x: x**3)
        assert (await sq(3), await cu(3)) == (9, 27)

        async def scale(x: int, by: int) -> int:
            return x * by

        double = cache.cached(functools.partial(scale, by=2))
        triple = cache.cached(functools.partial(scale, by=3))
        assert (await double(5), await triple(5)) == (10, 15)

        class Model:
            def __init__(self, version: str) -> None:
                self.version = version

            def __cache_key__(self) -> str:
                return self.version

            async def __call__(self, x: int) -> str:
                return f"{self.version}:{x}"

        v1, v2 = cache.cached(Model("v1")), cache.cached(Model("v2"))
        assert (await v1(1), await v2(1)) == ("v1:1", "v2:1")


async def test_key_invalidate_and_condition(server_url: str, namespace: str) -> None:
    near = ac.connect(f"memory://near-{namespace}")
    client = ac.Tiered(near, ac.connect(server_url))
    async with ac.AsyncKVCache(client, namespace=namespace, l1_bytes=1 << 20) as cache:
        calls: list[int] = []

        @cache.cached(ttl=60, condition=lambda result: result is not None)
        async def lookup(user_id: int, lang: str = "en") -> dict[str, Any] | None:
            calls.append(user_id)
            return None if user_id < 0 else {"id": user_id, "n": len(calls)}

        key = lookup.key(7)
        assert key == lookup.key(user_id=7, lang="en") != lookup.key(7, "fr")
        assert isinstance(key, bytes) and key.startswith(cache.prefix)
        first = await lookup(7)
        assert await lookup(7) == first and calls == [7]
        assert (await near.read([key])).values[0] is not None  # a near-tier copy
        await lookup.invalidate(7)
        assert (await near.read([key])).values[0] is None  # gone from the near tier
        second = await lookup(7)
        assert second == {"id": 7, "n": 2} and calls == [7, 7]
        # condition: None is returned, never stored
        assert await lookup(-1) is None and await lookup(-1) is None
        assert calls == [7, 7, -1, -1]


async def test_errors_are_not_cached_and_reach_every_waiter(server_url: str,
                                                            namespace: str) -> None:
    async with ac.AsyncKVCache(ac.connect(server_url), namespace=namespace) as cache:
        calls: list[int] = []

        @cache.cached
        async def flaky(x: int) -> int:
            calls.append(x)
            await asyncio.sleep(0.01)
            if len(calls) == 1:
                raise RuntimeError("database down")
            return x

        results = await asyncio.gather(*[flaky(1) for _ in range(5)], return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results) and calls == [1]
        assert await flaky(1) == 1 and await flaky(1) == 1 and calls == [1, 1]


async def test_cached_many(server_url: str, namespace: str) -> None:
    async with ac.AsyncKVCache(ac.connect(server_url), namespace=namespace) as cache:
        asked: list[list[int]] = []

        @cache.cached_many(ttl=60)
        async def users(ids: list[int], lang: str = "en") -> dict[int, dict[str, Any]]:
            asked.append(list(ids))
            await asyncio.sleep(0.02)
            return {i: {"id": i, "lang": lang} for i in ids if i != 13}  # 13 does not exist

        assert await users([1, 2, 3]) == {i: {"id": i, "lang": "en"} for i in (1, 2, 3)}
        before = cache.stats()
        got = await users([4, 2, 13, 1, 5])
        after = cache.stats()
        assert list(got) == [4, 2, 1, 5] and asked == [[1, 2, 3], [4, 13, 5]]
        assert after["batches"] - before["batches"] == 1  # the hits: one multi-get
        assert after["set_batches"] - before["set_batches"] == 1  # the results: one write
        assert (await users([13])) == {} and asked[-1] == [13]  # left out: not stored
        assert await users(ids=[1], lang="en") == {1: {"id": 1, "lang": "en"}}
        assert (await users([1], "fr"))[1]["lang"] == "fr" and asked[-1] == [1]
        # concurrent calls with overlapping ids compute each id once
        asked.clear()
        a, b = await asyncio.gather(users([20, 21, 22]), users([22, 23, 21]))
        assert sorted(i for call in asked for i in call) == [20, 21, 22, 23]
        assert a[22] == b[22] and a[22] is not b[22]
        assert users.key([20]) == {20: users.key([20, 21])[20]}
        await users.invalidate([20])
        await users([20, 21])
        assert asked[-1] == [20]
