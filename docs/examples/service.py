"""An aiohttp service with cached handlers: ``@cache.cached`` and ``@cache.cached_many`` in
front of a slow call, and ``invalidate`` when the data changes.

Run it against any store (``python docs/examples/service.py redis://127.0.0.1:6379/0``)
and ask ``/users/7?lang=fr``: the first request waits for the "database", the next ones
are served from the store, and a burst of identical requests computes once.
``/users?ids=1,2,3`` reads the known users in one multi-get and asks the database once for
the rest; ``DELETE /users/7`` drops user 7's cached profile.
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

    @cache.cached(ttl=60)  # key: this function, user_id and lang
    async def profile(user_id: int, lang: str = "en") -> dict[str, object]:
        app[COMPUTED].append(user_id)
        await asyncio.sleep(0.05)  # the slow database or remote API
        return {"id": user_id, "lang": lang, "name": f"user {user_id}"}

    @cache.cached_many(ttl=60)  # one key per id; called with the missing ids only
    async def profiles(ids: list[int]) -> dict[int, dict[str, object]]:
        app[COMPUTED].append(list(ids))
        await asyncio.sleep(0.05)  # one query for the whole batch
        return {i: {"id": i, "name": f"user {i}"} for i in ids if i > 0}  # 0: no such user

    async def get_user(request: web.Request) -> web.Response:
        user = int(request.match_info["user"])
        return web.json_response(await profile(user, request.query.get("lang", "en")))

    async def get_users(request: web.Request) -> web.Response:
        ids = [int(i) for i in request.query["ids"].split(",")]
        found = await profiles(ids)
        return web.json_response({str(i): user for i, user in found.items()})

    async def delete_user(request: web.Request) -> web.Response:
        user = int(request.match_info["user"])
        await profile.invalidate(user, request.query.get("lang", "en"))
        await profiles.invalidate([user])
        return web.Response(status=204)

    async def cache_lifetime(_app: web.Application) -> AsyncIterator[None]:
        async with cache:  # flushes and closes the store connections at shutdown
            yield

    app.router.add_get("/users/{user}", get_user)
    app.router.add_delete("/users/{user}", delete_user)
    app.router.add_get("/users", get_users)
    app.cleanup_ctx.append(cache_lifetime)
    return app


if __name__ == "__main__":
    web.run_app(make_app(sys.argv[1] if len(sys.argv) > 1 else "memory://service"),
                host="127.0.0.1", port=8080)
