"""The service of ``service.py`` on FastAPI (Starlette): the same cached handlers, the
cache opened and closed by the app's lifespan.

Run it with uvicorn against any store::

    ASYNCCACHE_URL=redis://127.0.0.1:6379/0 uvicorn --factory fastapi_service:make_app
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from fastapi import FastAPI, Response

import asynccache as ac


def make_app(url: str | None = None, namespace: str = "profiles-v1") -> FastAPI:
    cache = ac.AsyncKVCache(ac.connect(url or os.environ.get("ASYNCCACHE_URL", "memory://")),
                            namespace=namespace, ttl=300)
    computed: list[object] = []

    @cache.cached(ttl=60)  # key: this function, user_id and lang
    async def profile(user_id: int, lang: str = "en") -> dict[str, object]:
        computed.append(user_id)
        await asyncio.sleep(0.05)  # the slow database or remote API
        return {"id": user_id, "lang": lang, "name": f"user {user_id}"}

    @cache.cached_many(ttl=60)  # one key per id; called with the missing ids only
    async def profiles(ids: list[int]) -> dict[int, dict[str, object]]:
        computed.append(list(ids))
        await asyncio.sleep(0.05)  # one query for the whole batch
        return {i: {"id": i, "name": f"user {i}"} for i in ids if i > 0}  # 0: no such user

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with cache:  # flushes and closes the store connections at shutdown
            yield

    app = FastAPI(lifespan=lifespan)
    app.state.computed = computed

    @app.get("/users/{user_id}")
    async def get_user(user_id: int, lang: str = "en") -> dict[str, object]:
        return await profile(user_id, lang)

    @app.get("/users")
    async def get_users(ids: str) -> dict[str, dict[str, object]]:
        found = await profiles([int(i) for i in ids.split(",")])
        return {str(i): user for i, user in found.items()}

    @app.delete("/users/{user_id}", status_code=204)
    async def delete_user(user_id: int, lang: str = "en") -> Response:
        await profile.invalidate(user_id, lang)
        await profiles.invalidate([user_id])
        return Response(status_code=204)

    return app
