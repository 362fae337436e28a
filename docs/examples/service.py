"""An aiohttp service with a cached handler: ``@cache.cached`` in front of a slow call.

Run it against any store (``python docs/examples/service.py redis://127.0.0.1:6379/0``)
and ask ``/users/7?lang=fr``: the first request waits for the "database", the next ones
are served from the store, and a burst of identical requests computes once.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

from aiohttp import web

import asynccache as ac

COMPUTED = web.AppKey("computed", list)


def make_app(url: str, namespace: str = "profiles-v1") -> web.Application:
    app = web.Application()
    app[COMPUTED] = []
    cache = ac.AsyncKVCache(ac.connect(url), namespace=namespace, ttl=300)

    @cache.cached(ttl=60)  # key: this function's name, user_id and lang
    async def profile(user_id: int, lang: str = "en") -> dict[str, object]:
        app[COMPUTED].append(user_id)
        await asyncio.sleep(0.05)  # the slow database or remote API
        return {"id": user_id, "lang": lang, "name": f"user {user_id}"}

    async def get_user(request: web.Request) -> web.Response:
        user = int(request.match_info["user"])
        return web.json_response(await profile(user, request.query.get("lang", "en")))

    async def cache_lifetime(_app: web.Application) -> AsyncIterator[None]:
        async with cache:  # flushes and closes the store connections at shutdown
            yield

    app.router.add_get("/users/{user}", get_user)
    app.cleanup_ctx.append(cache_lifetime)
    return app


if __name__ == "__main__":
    web.run_app(make_app(sys.argv[1] if len(sys.argv) > 1 else "memory://service"),
                host="127.0.0.1", port=8080)
