"""One contract for every store: the built-ins, LMDB, a provider from outside the
package (``tests/outside_provider``, a SQLite file) and ``Tiered`` (LMDB in front of
Redis, Valkey in front of memcached), all on real stores.

The tests are plain functions that run their own event loop (``asyncio.run``), so the
fork test forks a process that has no loop running.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import pytest

import asynccache as ac
from asynccache.store.registry import unregister_scheme
from conftest import url_for
from outside_provider.sqlite_store import SqliteStore

STORES = ["redis", "memcached", "cluster", "memory", "lmdb", "sqlite", "tiered",
          "tiered-valkey"]
SHARED = {"redis", "memcached", "cluster", "lmdb", "sqlite", "tiered", "tiered-valkey"}


def tiered(url: str, **options: Any) -> ac.BaseClient:
    """``tiered-contract://?near=URL&far=URL`` (each quoted): ``ac.Tiered`` of the two, so
    that the contract's ``ac.connect(url)`` builds one."""
    query = dict(parse_qsl(urlsplit(url).query))
    return ac.Tiered(ac.connect(query["near"], **options), ac.connect(query["far"], **options))


@pytest.fixture(scope="module", autouse=True)
def _schemes() -> Iterator[None]:
    ac.register_scheme("sqlite", SqliteStore.from_url)
    ac.register_scheme("tiered-contract", tiered)
    yield
    unregister_scheme("sqlite")
    unregister_scheme("tiered-contract")


@pytest.fixture(params=STORES)
def contract_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "lmdb":
        return f"lmdb://{tmp_path}/lmdb?map_size=64MiB"
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/store.db"
    if request.param == "tiered":
        near, far = f"lmdb://{tmp_path}/near?map_size=64MiB", url_for("redis", request)
    elif request.param == "tiered-valkey":
        near, far = url_for("valkey", request), url_for("memcached", request)
    else:
        return url_for(request.param, request)
    return f"tiered-contract://?near={quote(near, safe='')}&far={quote(far, safe='')}"


def config(client: Any) -> Any:
    """What a client's pickle carries, clients inside it (a tiered one's) by theirs."""
    if isinstance(client, ac.BaseClient):
        return type(client), {name: config(value)
                              for name, value in client.__getstate__().items()}
    return client


def run(client: ac.BaseClient, body: Callable[[ac.BaseClient], Awaitable[Any]]) -> Any:
    """``body(client)`` in a fresh event loop, the loop's connections closed after."""
    async def main() -> Any:
        try:
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(main())


def keys_for(namespace: str, n: int) -> list[bytes]:
    return [f"{namespace}:{i}".encode() for i in range(n)]


def test_set_get_delete_and_missing(contract_url: str, namespace: str) -> None:
    keys = keys_for(namespace, 20)

    async def body(c: ac.BaseClient) -> None:
        await c.set_many({k: b"v" + k for k in keys})
        await c.set_many({keys[0]: b""})  # empty is a value, not a miss
        missing = f"{namespace}:nope".encode()
        got = await c.get_many([*keys, missing, keys[1]])
        assert got == [b"", *[b"v" + k for k in keys[1:]], None, b"v" + keys[1]]
        await c.delete_many([*keys[:10], missing])
        assert await c.get_many(keys) == [None] * 10 + [b"v" + k for k in keys[10:]]
        await c.ping()

    run(ac.connect(contract_url), body)


def test_contains_and_sizes_agree_with_the_values(contract_url: str, namespace: str) -> None:
    """What ``asynccache warm`` checks (Redis STRLEN, memcached ``mg k s``: no value sent)."""
    keys = keys_for(namespace, 30)
    values = {k: bytes([i]) * (1 + 700 * i) for i, k in enumerate(keys[:20])}

    async def body(c: ac.BaseClient) -> None:
        await c.set_many(values)
        assert await c.contains_many(keys) == [True] * 20 + [False] * 10
        sizes = await c.sizes_many(keys)
        assert sizes == [len(values[k]) for k in keys[:20]] + [None] * 10
        assert await c.sizes_many([]) == [] and await c.contains_many([]) == []

    run(ac.connect(contract_url), body)


def test_ttl_expires(contract_url: str, namespace: str) -> None:
    short, long = keys_for(namespace, 2)

    async def body(c: ac.BaseClient) -> None:
        await c.set_many({short: b"x"}, ttl=1)
        await c.set_many({long: b"y"}, ttl=60)
        assert await c.get_many([short, long]) == [b"x", b"y"]
        await asyncio.sleep(1.2 + c.expiry_slack)  # memcached counts whole seconds
        assert await c.get_many([short, long]) == [None, b"y"]

    run(ac.connect(contract_url), body)


def test_add_many_is_set_if_absent_honouring_expiry(contract_url: str, namespace: str) -> None:
    fresh, taken, expiring = keys_for(namespace, 3)

    async def body(c: ac.BaseClient) -> None:
        await c.set_many({taken: b"old"})
        await c.set_many({expiring: b"old"}, ttl=1)
        assert await c.add_many({fresh: b"new", taken: b"new"}, 30) == [True, False]
        assert await c.get_many([fresh, taken]) == [b"new", b"old"]
        await asyncio.sleep(1.2 + c.expiry_slack)
        assert await c.add_many({expiring: b"new"}, 30) == [True]
        assert await c.get_many([expiring]) == [b"new"]

    run(ac.connect(contract_url), body)


def test_pickle_round_trip_is_configuration(contract_url: str, namespace: str) -> None:
    (key,) = keys_for(namespace, 1)
    client = ac.connect(contract_url)

    async def write(c: ac.BaseClient) -> None:
        await c.set_many({key: b"before"})

    run(client, write)
    clone = pickle.loads(pickle.dumps(client))
    assert type(clone) is type(client) and clone.safe_url == client.safe_url
    assert config(clone) == config(client)

    async def read(c: ac.BaseClient) -> list[bytes | None]:
        return await c.get_many([key])

    assert run(clone, read) == [b"before"]


def _child(client: ac.BaseClient, namespace: str, shared: bool) -> None:
    before, after = keys_for(namespace, 2)

    async def body(c: ac.BaseClient) -> None:
        assert await c.get_many([before]) == [b"parent"]
        await c.set_many({after: b"child"})
        assert await c.get_many([after]) == [b"child"]

    run(client, body)


def test_use_after_fork_in_a_child_process(contract_url: str, namespace: str) -> None:
    """The parent forks while its connections are open and its loop is running: the child
    must open its own, read what the parent wrote, and write what the parent then reads."""
    before, after = keys_for(namespace, 2)
    shared = contract_url.split(":")[0] != "memory"

    async def body(c: ac.BaseClient) -> list[bytes | None]:
        await c.set_many({before: b"parent"})
        assert await c.get_many([before]) == [b"parent"]
        proc = multiprocessing.get_context("fork").Process(
            target=_child, args=(c, namespace, shared))
        proc.start()
        await asyncio.to_thread(proc.join, 60)
        assert proc.exitcode == 0
        return await c.get_many([before, after])

    expected = [b"parent", b"child" if shared else None]
    assert run(ac.connect(contract_url), body) == expected
