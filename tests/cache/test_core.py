"""AsyncKVCache contract on every real backend (plus memory:// for core-only logic)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct
import threading
import zlib

import numpy as np
import pytest
import torch

import asynccache as ac

pytestmark = pytest.mark.anyio

FALSY = {"none": None, "zero": 0, "false": False, "empty-bytes": b"", "empty-str": "",
         "empty-list": [], "empty-dict": {}}


async def test_falsy_values_are_hits(client: ac.BaseClient, namespace: str) -> None:
    async with ac.AsyncKVCache(client, namespace=namespace) as cache:
        await cache.set_many(FALSY)
        hits = await cache.get_many([*FALSY, "absent"])
        assert hits == FALSY and "absent" not in hits
        for key, value in FALSY.items():
            got = await cache.get(key, default="DEFAULT")
            assert got == value and type(got) is type(value)
        assert await cache.get("absent", default="DEFAULT") == "DEFAULT"


async def test_objects_roundtrip(client: ac.BaseClient, namespace: str) -> None:
    value = {"img": np.arange(3 * 32 * 32, dtype=np.uint8).reshape(3, 32, 32),
             "t": torch.linspace(0, 1, 100), "label": 7, "meta": ("a", [1.5, None])}
    async with ac.AsyncKVCache(client, namespace=namespace) as cache:
        await cache.set("x", value)
        got = await cache.get("x")
    assert np.array_equal(got["img"], value["img"]) and torch.equal(got["t"], value["t"])
    assert got["label"] == 7 and got["meta"] == ("a", [1.5, None])


async def test_concurrent_gets_are_coalesced(client: ac.BaseClient, namespace: str) -> None:
    async with ac.AsyncKVCache(client, namespace=namespace) as cache:
        await cache.set_many({i: i * i for i in range(100)})
        before = cache.stats()["batches"]
        keys = [i % 150 for i in range(200)]  # 100 hits, 50 misses, duplicates
        got = await asyncio.gather(*(cache.get(k, default=-1) for k in keys))
        assert got == [k * k if k < 100 else -1 for k in keys]
        stats = cache.stats()
        assert stats["batches"] - before <= 2  # one multi-get (chunked by the client)
        assert stats["coalesced"] == 50


async def test_namespaces_isolate(client: ac.BaseClient, namespace: str) -> None:
    a = ac.AsyncKVCache(client, namespace=namespace + "-a")
    b = ac.AsyncKVCache(client, namespace=namespace + "-b")
    await a.set("k", "from a")
    assert await b.get_many(["k"]) == {}
    assert a.key("k") == f"ac:{namespace}-a:s:k".encode()  # str keys are tagged: no clash
    assert a.key("5") != a.key(5)
    assert a.key(5) == f"ac:{namespace}-a:5".encode()
    await a.flush()


async def test_get_or_compute_sync_and_async_once(client: ac.BaseClient, namespace: str) -> None:
    calls: list[str] = []

    def compute_sync() -> str:
        calls.append("sync")
        return "S"

    async def compute_async() -> None:
        calls.append("async")
        await asyncio.sleep(0.01)
        return None  # a cached None must not trigger recomputation

    async with ac.AsyncKVCache(client, namespace=namespace) as cache:
        results = await asyncio.gather(*(cache.get_or_compute("s", compute_sync)
                                         for _ in range(5)))
        assert results == ["S"] * 5
        assert await cache.get_or_compute("n", compute_async) is None
        assert await cache.get_or_compute("n", compute_async) is None
        assert await cache.get("s") == "S"
    assert calls == ["sync", "async"]


async def test_delete(client: ac.BaseClient, namespace: str) -> None:
    async with ac.AsyncKVCache(client, namespace=namespace) as cache:
        await cache.set_many({"a": 1, "b": 2})
        await cache.delete("a")
        assert await cache.get_many(["a", "b"]) == {"b": 2}


async def test_cache_ttl(client: ac.BaseClient, namespace: str) -> None:
    async with ac.AsyncKVCache(client, namespace=namespace, ttl=1) as cache:
        await cache.set("short", 1)
        await cache.set("long", 2, ttl=None)
        await asyncio.sleep(2.1)
        assert await cache.get_many(["short", "long"]) == {"long": 2}


async def test_large_values_are_chunked_on_memcached(
    memcached_server, namespace: str  # type: ignore[no-untyped-def]
) -> None:
    client = ac.connect(memcached_server.url)
    big = np.random.default_rng(0).integers(0, 255, size=3 * 1024 * 1024, dtype=np.uint8)
    try:
        async with ac.AsyncKVCache(client, namespace=namespace) as cache:
            await cache.set("big", big)
            got = await cache.get("big")
            assert np.array_equal(got, big)
            assert cache.stats()["chunked_values"] == 1
            strict = ac.AsyncKVCache(client, namespace=namespace, chunking=False)
            with pytest.raises(ac.ValueTooLarge, match="chunking"):
                await strict.set("big2", big)
    finally:
        await client.close()


async def test_evicted_chunk_is_a_miss(namespace: str) -> None:
    client = ac.MemoryClient(name=namespace, max_value_size=4096)
    cache = ac.AsyncKVCache(client, namespace=namespace)
    await cache.set("v", bytes(range(256)) * 100)
    chunk_keys = [k for k in client.data if k.startswith(cache.prefix + b"c:")]
    assert len(chunk_keys) >= 2
    assert await cache.get("v") == bytes(range(256)) * 100
    del client.data[chunk_keys[0]]
    assert await cache.get("v", default="miss") == "miss"


async def test_user_errors_raise(client: ac.BaseClient, namespace: str) -> None:
    cache = ac.AsyncKVCache(client, namespace=namespace)
    with pytest.raises(ac.EncodeError):
        await cache.set("lock", threading.Lock())
    with pytest.raises(ac.KeyTooLong, match="max_key_size"):
        await cache.get("k" * 2000)
    with pytest.raises(ac.KeyTooLong):
        ac.AsyncKVCache(client, namespace="n" * 500)
    with pytest.raises(ac.ConfigError, match="on_error"):
        ac.AsyncKVCache(client, namespace=namespace, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ac.KeyEncodingError, match="as a cache key"):
        await cache.get(1.5)


async def test_foreign_bytes_are_a_counted_miss(
    client: ac.BaseClient, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ac.AsyncKVCache(client, namespace=namespace)
    await client.set_many({cache.key(i): b"not ours" for i in range(3)})
    trunc = cache.key("trunc")
    await client.set_many({trunc: ac.Codec().encode(list(range(100)), trunc)[:-5]})
    with caplog.at_level(logging.WARNING, logger="asynccache"):
        assert await cache.get_many([0, 1, 2, "trunc"]) == {}
    stats = cache.stats()
    assert stats["decode_errors"] == 4 and stats["errors"] == 4 and stats["misses"] == 4
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    strict = ac.AsyncKVCache(client, namespace=namespace, on_error="raise")
    with pytest.raises(ac.DecodeError):
        await strict.get(0)
    await client.close()


async def test_write_behind_flush(client: ac.BaseClient, namespace: str) -> None:
    async with ac.AsyncKVCache(client, namespace=namespace) as cache:
        writer = cache.writer
        writer.write_later(writer.encode_values({cache.key(i): i for i in range(500)}))
        writer.start()  # in the cache's loop, as a pipe's loop thread starts it
        await cache.flush()
        assert len(await cache.get_many(range(500))) == 500


async def test_write_behind_queue_is_bounded(namespace: str) -> None:
    cache = ac.AsyncKVCache(ac.MemoryClient(name=namespace), namespace=namespace,
                            max_pending_writes=100)
    cache.writer.write_later(cache.writer.encode_values({cache.key(i): i for i in range(300)}))
    cache.writer.start()
    await cache.flush()
    assert cache.stats()["writes_dropped"] == 200
    assert len(await cache.get_many(range(300))) == 100


async def test_a_value_copied_under_another_key_is_a_counted_miss(
    client: ac.BaseClient, namespace: str
) -> None:
    cache = ac.AsyncKVCache(client, namespace=namespace)
    await cache.set_many({"a": "value of a", "b": "value of b"})
    (blob_a,) = await client.get_many([cache.key("a")])
    await client.set_many({cache.key("b"): blob_a})  # any writer of the store can do this
    assert await cache.get_many(["a", "b"]) == {"a": "value of a"}
    stats = cache.stats()
    assert stats["decode_errors"] == 1 and stats["misses"] == 1 and stats["hits"] == 1
    await client.close()


async def test_values_of_another_format_version_are_plain_misses(
    client: ac.BaseClient, namespace: str
) -> None:
    cache = ac.AsyncKVCache(client, namespace=namespace)
    payload = pickle.dumps("written by asynccache 0.1", 5)
    v1 = struct.pack("<3sBI", b"\xacC\x01", 0, zlib.crc32(payload, zlib.crc32(b"\x01\x00")))
    await client.set_many({cache.key("old"): v1 + payload})
    assert await cache.get_or_compute("old", lambda: "recomputed") == "recomputed"
    assert await cache.get("old") == "recomputed"  # overwritten in the current format
    stats = cache.stats()
    assert stats["outdated"] == 1 and stats["errors"] == 0 and stats["decode_errors"] == 0
    await client.close()
