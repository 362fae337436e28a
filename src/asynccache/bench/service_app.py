"""One small aiohttp service for the `services` benchmark, run as its own process:

    python -m asynccache.bench.service_app KIND REDIS_URL

KIND is how it caches the same slow lookup in the same Redis: ``asynccache``
(`AsyncKVCache.get_or_compute`), ``aiocache`` (its ``@cached`` decorator on a
`RedisCache`) or ``redis`` (plain ``redis.asyncio``: ``GET``, on a miss compute and
``SET``). Each stores the same value (a small dict, pickled) under its own prefix with
the same TTL and answers with the same JSON, so what differs between them is only the
caching layer.

Routes: ``GET /item/{key}`` (the cached lookup) and ``GET /computed`` (how many times
the lookup ran in this process: the stampede count). The process binds a free port on
127.0.0.1, prints it on stdout, and serves until SIGTERM or SIGINT. Each runs on uvloop
when it is installed, so the event loop is not what differs either.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

__all__ = ["KINDS", "VALUE_BYTES", "compute", "main"]

KINDS = ("asynccache", "aiocache", "redis")
#: seconds the uncached lookup takes (a database or a remote API)
COMPUTE_S = 0.02
#: size of the text in a value: the response is ~1 KiB of JSON
VALUE_BYTES = 900
TTL = 3600  # seconds
NAMESPACE = {"asynccache": "svc-asynccache", "aiocache": "svc-aiocache",
             "redis": "svc-redis"}

Lookup = Callable[[str], Awaitable[dict[str, Any]]]


class Counter:
    def __init__(self) -> None:
        self.computed = 0


async def compute(key: str, counter: Counter) -> dict[str, Any]:
    """The slow lookup every service caches: a deterministic record for ``key``."""
    counter.computed += 1
    await asyncio.sleep(COMPUTE_S)
    text = (key * (VALUE_BYTES // max(1, len(key)) + 1))[:VALUE_BYTES]
    return {"id": key, "name": f"item {key}", "text": text}


async def asynccache_lookup(url: str, counter: Counter) -> tuple[Lookup, Callable[[], Any]]:
    import asynccache as ac

    cache = ac.AsyncKVCache(ac.connect(url), namespace=NAMESPACE["asynccache"], ttl=TTL)

    async def lookup(key: str) -> dict[str, Any]:
        value: dict[str, Any] = await cache.get_or_compute(key, lambda: compute(key, counter))
        return value

    return lookup, cache.aclose


async def aiocache_lookup(url: str, counter: Counter) -> tuple[Lookup, Callable[[], Any]]:
    from urllib.parse import urlsplit

    from aiocache import RedisCache, cached
    from aiocache.serializers import PickleSerializer

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    db = int(parts.path.strip("/") or 0)
    if "alias" in inspect.signature(cached).parameters:  # aiocache 0.x: settings by keyword
        decorator = cached(ttl=TTL, namespace=NAMESPACE["aiocache"], cache=RedisCache,
                           serializer=PickleSerializer(), endpoint=host, port=port, db=db,
                           noself=False)
        close: Callable[[], Any] = _nothing
    else:  # aiocache 1.x: a cache object over a redis.asyncio client
        import redis.asyncio as aioredis

        client = aioredis.Redis(host=host, port=port, db=db)
        backend = RedisCache(client=client, namespace=NAMESPACE["aiocache"],
                             serializer=PickleSerializer())
        decorator = cached(backend, ttl=TTL)
        close = client.aclose

    @decorator
    async def lookup(key: str) -> dict[str, Any]:
        return await compute(key, counter)

    return lookup, close


async def redis_lookup(url: str, counter: Counter) -> tuple[Lookup, Callable[[], Any]]:
    import redis.asyncio as aioredis

    # A pool that waits for a free connection when all are busy (the default one raises
    # MaxConnectionsError past 100 at once: 200 concurrent requests of one key do that).
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=100, timeout=None)
    client = aioredis.Redis(connection_pool=pool)
    prefix = NAMESPACE["redis"] + ":"
    loads: Callable[[Any], dict[str, Any]] = pickle.loads  # bytes: no decode_responses

    async def lookup(key: str) -> dict[str, Any]:
        raw = await client.get(prefix + key)
        if raw is not None:
            return loads(raw)
        value = await compute(key, counter)
        await client.set(prefix + key, pickle.dumps(value, protocol=5), ex=TTL)
        return value

    return lookup, client.aclose


async def _nothing() -> None:
    return None


LOOKUPS = {"asynccache": asynccache_lookup, "aiocache": aiocache_lookup,
           "redis": redis_lookup}


async def serve(kind: str, url: str) -> None:
    counter = Counter()
    lookup, close = await LOOKUPS[kind](url, counter)

    async def item(request: web.Request) -> web.Response:
        return web.json_response(await lookup(request.match_info["key"]))

    async def computed(_request: web.Request) -> web.Response:
        return web.json_response({"computed": counter.computed})

    app = web.Application()
    app.router.add_get("/item/{key}", item)
    app.router.add_get("/computed", computed)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock, backlog=1024)
    await site.start()
    print(sock.getsockname()[1], flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        result = close()
        if inspect.isawaitable(result):
            await result


def main(argv: list[str] | None = None) -> int:
    kind, url = (sys.argv[1:] if argv is None else argv)[:2]
    if kind not in KINDS:
        print(f"service_app: KIND must be one of {', '.join(KINDS)}, not {kind!r}",
              file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(kind, url))
    else:
        uvloop.run(serve(kind, url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
