"""``@cache.cached``: keys from the call, one computation per burst, own objects, and the
example service of the docs on real servers."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

import asynccache as ac
from asynccache.testing import servers

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[1]


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


async def test_key_callable_methods_and_plain_functions(url: str, namespace: str) -> None:
    computed: list[Any] = []
    async with ac.AsyncKVCache(ac.connect(url), namespace=namespace) as cache:

        @cache.cached(key=lambda path, **_options: ("file", path))
        async def load(path: str, verbose: bool = False) -> str:
            computed.append(path)
            return path.upper()

        assert await load("a", verbose=True) == await load("a") == "A"

        class Service:
            @cache.cached
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
        async def scale(factor: float) -> float:
            return factor

        with pytest.raises(ac.KeyEncodingError, match="cache key"):
            await scale(1.5)
        with pytest.raises(ac.ConfigError, match="ttl"):
            cache.cached(ttl=0)(scale)
        with pytest.raises(ac.ConfigError, match="key="):
            cache.cached(key="name")(scale)  # type: ignore[arg-type]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("service_example",
                                                  ROOT / "docs" / "examples" / "service.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_the_example_service_of_the_docs(redis_server: servers.RedisServer,
                                               namespace: str, anyio_backend: Any) -> None:
    from aiohttp import ClientSession, web

    service = _example()
    app = service.make_app(redis_server.url, f"{namespace}-{anyio_backend[1]['use_uvloop']}")
    runner = web.AppRunner(app)
    await runner.setup()
    port = servers.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with ClientSession() as http:
            async def get(path: str) -> Any:
                async with http.get(f"http://127.0.0.1:{port}{path}") as response:
                    assert response.status == 200
                    return await response.json()

            burst = await asyncio.gather(*[get("/users/9?lang=fr") for _ in range(30)])
            assert burst[0] == {"id": 9, "lang": "fr", "name": "user 9"}
            assert all(b == burst[0] for b in burst) and app[service.COMPUTED] == [9]
            assert (await get("/users/9?lang=fr")) == burst[0]
            assert app[service.COMPUTED] == [9]
    finally:
        await runner.cleanup()
