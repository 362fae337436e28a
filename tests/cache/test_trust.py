"""Acceptance: a cache whose store others can write to, on a real Redis.

Anyone with write access to the store forges values with the raw client; a signing or
pickle-free cache (and the DataPipe, and DataLoader workers) must see misses, never run
the forged code, and serve what its own writers stored.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from torch.utils.data import DataLoader

import asynccache as ac
from asynccache.cache.codec.codec import MAGIC
from asynccache.errors import SignatureError
from asynccache.testing import servers

NEW = "new-secret-fedcba9876543210fedcba9876"
OLD = "old-secret-0123456789abcdef0123456789"
ALIEN = "an attacker's own secret, 0123456789"
F_OOB, F_MAC = 0b100, 0b10_0000

TRUSTED = {
    "signed": lambda: ac.Codec(secret=NEW),
    "pickle-free": lambda: ac.Codec(allow_pickle=False),
    "signed-pickle-free": lambda: ac.Codec(secret=NEW, allow_pickle=False, compression="zstd"),
}


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    yield
    gc.collect()


@pytest.fixture
async def client(redis_server: servers.RedisServer) -> AsyncIterator[ac.BaseClient]:
    c = ac.connect(redis_server.url)
    yield c
    await c.close()


class Evil:
    """Unpickling this runs a shell command that creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.path}'",))


def seal(flags: int, payload: bytes, key: bytes) -> bytes:
    """Header + recomputed xxh3 tag, from the documented format: what a forger can write."""
    seed = xxhash.xxh3_64_intdigest(key, xxhash.xxh3_64_intdigest(bytes([2, flags])))
    tag = struct.pack("<Q", xxhash.xxh3_64_intdigest(payload, seed))
    return MAGIC + bytes([2, flags]) + tag + payload


def forgeries(marker: Path, key: bytes) -> list[bytes]:
    """Malicious pickles for ``key``: checksummed, claiming a signature, out-of-band, large."""
    evil = pickle.dumps(Evil(marker), 5)
    big = pickle.dumps([Evil(marker), bytes(100_000)], 5)
    table = struct.pack("<QIQ", len(evil), 1, 3) + evil + b"buf"
    return [
        seal(0, evil, key),
        seal(0, big, key),
        seal(F_OOB, table, key),
        MAGIC + bytes([2, F_MAC]) + bytes(16) + evil,
        seal(F_MAC, evil, key),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("trust", list(TRUSTED))
async def test_forged_values_are_misses_and_never_run(
    client: ac.BaseClient, namespace: str, tmp_path: Path, trust: str
) -> None:
    marker = tmp_path / "pwned"
    cache = ac.AsyncKVCache(client, namespace=namespace, codec=TRUSTED[trust]())
    n = len(forgeries(marker, b""))
    await client.set_many({cache.key(i): forgeries(marker, cache.key(i))[i] for i in range(n)})
    assert await cache.get_many(range(n)) == {}
    assert await cache.get(0, default="miss") == "miss"
    stats = cache.stats()
    assert stats["misses"] == n + 1 and stats["hits"] == 0
    assert stats["decode_errors"] + stats["bad_signatures"] == n + 1
    strict = ac.AsyncKVCache(client, namespace=namespace, codec=cache.codec, on_error="raise")
    with pytest.raises(SignatureError if cache.codec._signer else ac.DecodeError):
        await strict.get(0)
    # A miss is recomputed and overwritten with a value this codec trusts.
    assert await cache.get_or_compute(1, lambda: {"x": np.arange(3)}) is not None
    assert np.array_equal((await cache.get(1))["x"], np.arange(3))
    assert not marker.exists()
    # The same bytes do run code in a reader with the default codec: the threat is real.
    naive = ac.AsyncKVCache(client, namespace=namespace)
    await naive.get(0)
    assert marker.exists()


@pytest.mark.anyio
async def test_values_signed_with_another_secret_are_misses(
    client: ac.BaseClient, namespace: str
) -> None:
    alien = ac.AsyncKVCache(client, namespace=namespace, codec=ac.Codec(secret=ALIEN))
    await alien.set_many({i: f"forged {i}" for i in range(5)})
    await alien.set("big", torch.zeros(100_000))
    for make in TRUSTED.values():
        cache = ac.AsyncKVCache(client, namespace=namespace, codec=make())
        assert await cache.get_many([*range(5), "big"]) == {}
        stats = cache.stats()  # a signing codec: bad signatures; the others: undecodable
        assert stats["bad_signatures"] + stats["decode_errors"] == 6
        assert stats["bad_signatures"] == (6 if cache.codec._signer else 0)


@pytest.mark.anyio
async def test_rotation_serves_old_values_and_signs_with_the_new_secret(
    client: ac.BaseClient, namespace: str
) -> None:
    old = ac.AsyncKVCache(client, namespace=namespace, codec=ac.Codec(secret=OLD))
    rotated = ac.AsyncKVCache(client, namespace=namespace, codec=ac.Codec(secret=[NEW, OLD]))
    new = ac.AsyncKVCache(client, namespace=namespace, codec=ac.Codec(secret=NEW))
    await old.set_many({i: torch.full((4,), float(i)) for i in range(20)})
    got = await rotated.get_many(range(20))
    assert len(got) == 20 and all(torch.equal(got[i], torch.full((4,), float(i))) for i in got)
    assert rotated.stats()["hits"] == 20 and rotated.stats()["bad_signatures"] == 0
    await rotated.set_many({i: f"rewritten {i}" for i in range(10)})
    assert await new.get_many(range(20)) == {i: f"rewritten {i}" for i in range(10)}
    assert new.stats()["bad_signatures"] == 10  # the 10 still signed with OLD
    assert await old.get_many(range(10)) == {}  # [OLD] cannot read what NEW signed


@pytest.mark.anyio
@pytest.mark.parametrize("trust", list(TRUSTED))
async def test_a_value_copied_under_another_key_is_a_miss(
    client: ac.BaseClient, namespace: str, trust: str
) -> None:
    cache = ac.AsyncKVCache(client, namespace=namespace, codec=TRUSTED[trust]())
    await cache.set_many({"admin": {"role": "admin"}, "guest": {"role": "guest"}})
    (blob,) = await client.get_many([cache.key("admin")])
    await client.set_many({cache.key("guest"): blob})  # replayed by any writer of the store
    assert await cache.get_many(["admin", "guest"]) == {"admin": {"role": "admin"}}
    assert cache.stats()["decode_errors"] + cache.stats()["bad_signatures"] == 1


class Source(torch.utils.data.Dataset):
    """Map-style items; a module-level class so spawned workers can unpickle it.
    ``cached_only`` makes computing an item fail: every read must be a verified hit."""

    def __init__(self, n: int, cached_only: bool = False) -> None:
        self.n = n
        self.cached_only = cached_only

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.cached_only:
            raise AssertionError(f"item {index} was a miss")
        return {"index": index, "x": torch.full((8,), float(index)), "pair": (index, None)}


def check_item(item: dict[str, Any], index: int) -> None:
    assert item["index"] == index and item["pair"] == (index, None)
    assert torch.equal(item["x"], torch.full((8,), float(index)))


@pytest.mark.parametrize("trust", list(TRUSTED))
def test_datapipe_recomputes_forged_items(
    redis_server: servers.RedisServer, namespace: str, tmp_path: Path, trust: str
) -> None:
    marker = tmp_path / "pwned"
    codec = TRUSTED[trust]()
    with ac.AsyncKVCacheMapDataPipe(
        Source(50), ac.connect(redis_server.url), namespace=namespace, codec=codec
    ) as dp:
        for i in range(50):
            check_item(dp[i], i)
        dp.flush()
    keys = ac.AsyncKVCache(ac.MemoryClient(name=namespace), namespace=namespace)  # key names
    forged = {keys.key(i): forgeries(marker, keys.key(i))[i % 5] for i in range(0, 50, 5)}
    asyncio.run(write_raw(redis_server.url, forged))
    with ac.AsyncKVCacheMapDataPipe(
        Source(50), ac.connect(redis_server.url), namespace=namespace, codec=codec
    ) as dp:
        for i in range(50):
            check_item(dp[i], i)
        stats = dp.stats()
    assert stats["hits"] == 40 and stats["misses"] == 10
    assert stats["decode_errors"] + stats["bad_signatures"] == 10
    assert not marker.exists()


async def write_raw(url: str, entries: dict[bytes, bytes]) -> None:
    client = ac.connect(url)
    try:
        await client.set_many(entries)
    finally:
        await client.close()


def list_collate(batch: list[Any]) -> list[Any]:
    return batch


def test_spawned_dataloader_workers_read_the_secret_from_the_environment(
    redis_server: servers.RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A from_env codec crosses the pickle to spawned workers as a reference: the workers
    verify what the parent signed, and an explicit secret refuses to be pickled."""
    monkeypatch.setenv("ASYNCCACHE_SECRET", f"{NEW},{OLD}")
    codec = ac.Codec.from_env(allow_pickle=False)
    with ac.AsyncKVCacheMapDataPipe(
        Source(64), ac.connect(redis_server.url), namespace=namespace, codec=codec
    ) as dp:
        dp.__getitems__(list(range(64)))
        dp.flush()
    dp = ac.AsyncKVCacheMapDataPipe(
        Source(64, cached_only=True), ac.connect(redis_server.url), namespace=namespace,
        codec=codec,
    )
    loader = DataLoader(dp, batch_size=16, num_workers=2, multiprocessing_context="spawn",
                        collate_fn=list_collate)
    seen = []
    for batch in loader:
        for item in batch:
            check_item(item, item["index"])
            seen.append(item["index"])
    assert sorted(seen) == list(range(64))
    dp.close()
    explicit = ac.AsyncKVCacheMapDataPipe(
        Source(4), ac.connect(redis_server.url), namespace=namespace,
        codec=ac.Codec(secret=NEW),
    )
    with pytest.raises(ac.ConfigError, match="from_env"):
        pickle.dumps(explicit)
    explicit.close()
