"""The byte-level client contract on every real backend."""

from __future__ import annotations

import asyncio
import pickle

import pytest

import asynccache as ac
from asynccache.store.memcached.client import rendezvous_owner, safe_memcached_key
from asynccache.testing import servers

pytestmark = pytest.mark.anyio


async def test_set_get_delete_roundtrip(client: ac.BaseClient, namespace: str) -> None:
    keys = [f"{namespace}:{i}".encode() for i in range(10)]
    await client.set_many({k: b"v" + k for k in keys})
    assert await client.get_many(keys) == [b"v" + k for k in keys]
    await client.delete_many(keys[:5])
    assert await client.get_many(keys) == [None] * 5 + [b"v" + k for k in keys[5:]]


async def test_missing_keys_are_none_and_empty_values_are_not(
    client: ac.BaseClient, namespace: str
) -> None:
    await client.set_many({f"{namespace}:empty".encode(): b""})
    got = await client.get_many([f"{namespace}:empty".encode(), f"{namespace}:nope".encode()])
    assert got == [b"", None]


async def test_many_keys_span_several_batches_in_order(
    client: ac.BaseClient, namespace: str
) -> None:
    n = client.max_batch * 5 + 7
    keys = [f"{namespace}:{i}".encode() for i in range(n)]
    await client.set_many({k: str(i).encode() for i, k in enumerate(keys)})
    got = await client.get_many(keys[::-1])
    assert got == [str(i).encode() for i in range(n)][::-1]


async def test_duplicate_keys_in_one_request(client: ac.BaseClient, namespace: str) -> None:
    a, b = f"{namespace}:a".encode(), f"{namespace}:b".encode()
    await client.set_many({a: b"1"})
    assert await client.get_many([a, b, a, a]) == [b"1", None, b"1", b"1"]


async def test_ttl_expires(client: ac.BaseClient, namespace: str) -> None:
    key = f"{namespace}:ttl".encode()
    await client.set_many({key: b"x"}, ttl=1)
    assert await client.get_many([key]) == [b"x"]
    await asyncio.sleep(2.1)  # memcached's clock has one-second resolution
    assert await client.get_many([key]) == [None]


async def test_ping(client: ac.BaseClient) -> None:
    await client.ping()


async def test_pickled_client_reconnects(client: ac.BaseClient, namespace: str) -> None:
    key = f"{namespace}:p".encode()
    await client.set_many({key: b"before"})
    clone = pickle.loads(pickle.dumps(client))
    try:
        assert await clone.get_many([key]) == [b"before"]
    finally:
        await clone.close()


async def test_memcached_unsafe_keys_are_mapped_and_distinct(
    request: pytest.FixtureRequest, namespace: str
) -> None:
    server = request.getfixturevalue("memcached_server")
    client = ac.connect(server.url)
    long_a = (namespace + "a" * 300).encode()
    long_b = (namespace + "a" * 299 + "b").encode()
    keys = [long_a, long_b, f"{namespace} with space".encode(), f"{namespace}\x01".encode(),
            f"{namespace}:ключ".encode()]
    try:
        await client.set_many({k: k[-8:] for k in keys})
        assert await client.get_many(keys) == [k[-8:] for k in keys]
    finally:
        await client.close()
    mapped = {safe_memcached_key(k) for k in keys}
    assert len(mapped) == len(keys)
    assert all(len(m) <= 250 and b" " not in m for m in mapped)


def test_rendezvous_hashing_moves_few_keys() -> None:
    keys = [f"k{i}".encode() for i in range(3000)]
    three = ["a:1", "b:1", "c:1"]
    four = [*three, "d:1"]
    before = [three[rendezvous_owner(k, three)] for k in keys]
    after = [four[rendezvous_owner(k, four)] for k in keys]
    moved = sum(x != y for x, y in zip(before, after))
    assert all(y == "d:1" for x, y in zip(before, after) if x != y)
    assert 0.15 < moved / len(keys) < 0.35  # about a quarter, not most keys


async def test_memcached_pool_spreads_keys(request: pytest.FixtureRequest, namespace: str) -> None:
    pool = request.getfixturevalue("memcached_pool")
    url = "memcached://" + ",".join(f"{s.host}:{s.port}" for s in pool)
    client = ac.connect(url)
    keys = [f"{namespace}:{i}".encode() for i in range(200)]
    try:
        await client.set_many({k: k for k in keys})
        assert await client.get_many(keys) == keys
    finally:
        await client.close()
    per_server = []
    for server in pool:
        single = ac.connect(server.url)
        try:
            per_server.append(sum(v is not None for v in await single.get_many(keys)))
        finally:
            await single.close()
    assert sum(per_server) == len(keys) and min(per_server) > 40


async def test_redis_password_from_url() -> None:
    with servers.start_redis(password="p@ss word") as server:
        good = ac.connect(server.url)
        bad = ac.connect(f"redis://:wrong@{server.host}:{server.port}/0")
        try:
            await good.set_many({b"k": b"v"})
            assert await good.get_many([b"k"]) == [b"v"]
            with pytest.raises(ac.StoreUnavailable, match="credentials"):
                await bad.get_many([b"k"])
        finally:
            await good.close()
            await bad.close()
        assert "p@ss" not in repr(good)


async def test_redis_db_number_isolates(redis_server: servers.RedisServer) -> None:
    db1 = ac.connect(f"redis://{redis_server.host}:{redis_server.port}/1")
    db2 = ac.connect(f"redis://{redis_server.host}:{redis_server.port}/2")
    try:
        await db1.set_many({b"same": b"one"})
        assert await db2.get_many([b"same"]) == [None]
    finally:
        await db1.close()
        await db2.close()


async def test_connection_refused_is_store_unavailable() -> None:
    port = servers.free_port()
    for url in (f"redis://127.0.0.1:{port}/0", f"memcached://127.0.0.1:{port}"):
        client = ac.connect(url, timeout=0.5)
        try:
            with pytest.raises(ac.StoreUnavailable):
                await client.get_many([b"k"])
        finally:
            await client.close()


@pytest.mark.parametrize("servers_fixture", ["memcached_server", "memcached_pool"])
async def test_memcached_consumer_reads_answer_like_get_many(
    request: pytest.FixtureRequest, servers_fixture: str, namespace: str
) -> None:
    """The consumer-side connections (read-ahead) route by owner, map unsafe keys and
    fold duplicates exactly as the asyncio client does."""
    found = request.getfixturevalue(servers_fixture)
    pool = found if isinstance(found, list) else [found]
    client = ac.connect("memcached://" + ",".join(f"{s.host}:{s.port}" for s in pool),
                        max_batch=16)
    keys = [f"{namespace}:{i}".encode() for i in range(100)]
    await client.set_many({k: b"v" + k for k in keys[::2]})
    keys += [keys[4], f"{namespace}: not a memcached key".encode(), keys[4], keys[5]]
    await client.set_many({keys[-3]: b"unsafe"})
    reads = client.consumer_reads()
    try:
        assert [c.node for c in reads.connections] == list(client.node_names)
        assert client.node_names == tuple(f"{s.host}:{s.port}" for s in pool)
        routes = reads.route(keys)
        assert sorted(p for _, positions in routes for p in positions) == list(range(len(keys)))
        got: list[bytes | None] = [b"unset"] * len(keys)
        for index, positions in routes:
            conn = reads.connections[index]
            conn.send_get([keys[p] for p in positions])
            for position, value in zip(positions, conn.receive()):
                got[position] = value
        assert got == await client.get_many(keys)
        assert got[-3] == b"unsafe" and got[-4] == got[-2] == b"v" + keys[4] and got[-1] is None
    finally:
        for conn in reads.connections:
            conn.close()
        await client.close()
