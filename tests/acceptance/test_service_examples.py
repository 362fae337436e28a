"""The example services of the docs (docs/examples: aiohttp, FastAPI) started for real on a
free port, against Redis and memcached, and hit over HTTP with httpx: ``cached``,
``cached_many`` and ``invalidate`` as a service uses them."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from asynccache.testing import servers

pytestmark = pytest.mark.anyio
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def aiohttp_service(url: str, namespace: str) -> AsyncIterator[tuple[str, list[Any]]]:
    from aiohttp import web

    example = _load("service")
    app = example.make_app(url, namespace)
    runner = web.AppRunner(app)
    await runner.setup()
    port = servers.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", app[example.COMPUTED]
    finally:
        await runner.cleanup()


@asynccontextmanager
async def fastapi_service(url: str, namespace: str) -> AsyncIterator[tuple[str, list[Any]]]:
    import uvicorn

    app = _load("fastapi_service").make_app(url, namespace)
    port = servers.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    task = asyncio.ensure_future(server.serve())
    try:
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}", app.state.computed
    finally:
        server.should_exit = True
        await task


SERVICES: dict[str, Callable[[str, str], Any]] = {"aiohttp": aiohttp_service,
                                                  "fastapi": fastapi_service}


@pytest.mark.parametrize("framework", list(SERVICES))
@pytest.mark.parametrize("store", ["redis_server", "memcached_server"])
async def test_the_example_services_of_the_docs(framework: str, store: str, namespace: str,
                                                request: pytest.FixtureRequest,
                                                anyio_backend: Any) -> None:
    url = request.getfixturevalue(store).url
    namespace = f"{namespace}-{anyio_backend[1]['use_uvloop']}"
    async with SERVICES[framework](url, namespace) as (base, computed), \
            httpx.AsyncClient(base_url=base) as http:

        async def get(path: str) -> Any:
            response = await http.get(path)
            assert response.status_code == 200, response.text
            return response.json()

        burst = await asyncio.gather(*[get("/users/9?lang=fr") for _ in range(30)])
        assert burst[0] == {"id": 9, "lang": "fr", "name": "user 9"}
        assert all(b == burst[0] for b in burst) and computed == [9]
        assert await get("/users/9?lang=fr") == burst[0] and computed == [9]

        assert await get("/users?ids=1,2,0") == {"1": {"id": 1, "name": "user 1"},
                                                 "2": {"id": 2, "name": "user 2"}}
        assert await get("/users?ids=2,3,1") == {str(i): {"id": i, "name": f"user {i}"}
                                                 for i in (2, 3, 1)}
        assert computed == [9, [1, 2, 0], [3]]  # only the missing id asked for

        assert (await http.delete("/users/9?lang=fr")).status_code == 204
        assert (await http.delete("/users/2")).status_code == 204
        assert await get("/users/9?lang=fr") == burst[0]
        await get("/users?ids=1,2")
        assert computed == [9, [1, 2, 0], [3], 9, [2]]
