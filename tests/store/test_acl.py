"""Redis 6+ ACL users: a user limited to one namespace's keys and to the commands
asynccache sends; refusals are counted failures with messages that say what to grant."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

import asynccache as ac
from asynccache.testing import servers

USER_PASSWORD = "acl-Pa55word-only-for-ns-a"


class Source:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[str, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return ("acl", index)


def values(n: int) -> list[tuple[str, int]]:
    return [Source(n)[i] for i in range(n)]


@pytest.fixture(scope="module")
def acl(redis_server: servers.RedisServer) -> Iterator[tuple[str, str, str]]:
    """(url of a user allowed ac:<ns_a>:* and MGET/SET/DEL/PING only, ns_a, ns_b)."""
    tag = hashlib.sha1(__name__.encode()).hexdigest()[:8]
    user, ns_a, ns_b = f"acl-{tag}", f"acl-a-{tag}", f"acl-b-{tag}"
    redis_server.call("ACL", "SETUSER", user, "reset", "on", f">{USER_PASSWORD}",
                      f"~ac:{ns_a}:*", "+mget", "+set", "+del", "+ping")
    try:
        yield f"redis://{user}:{USER_PASSWORD}@127.0.0.1:{redis_server.port}/0", ns_a, ns_b
    finally:
        redis_server.call("ACL", "DELUSER", user)


def test_user_serves_its_namespace_on_both_paths(acl: tuple[str, str, str]) -> None:
    url, ns_a, _ = acl
    with ac.AsyncKVCacheMapDataPipe(Source(200), ac.connect(url), namespace=ns_a) as dp:
        assert [dp[i] for i in range(200)] == values(200)
        assert dp.__getitems__([0, 1]) == values(2)
    with ac.AsyncKVCacheMapDataPipe(Source(200), ac.connect(url), namespace=ns_a,
                                    on_error="raise") as dp:
        assert [dp[i] for i in range(200)] == values(200)
        stats = dp.stats()
    assert stats["hits"] == 200 and stats["errors"] == 0 and stats["prefetch_hits"] > 0


@pytest.mark.anyio
async def test_async_cache_in_its_namespace(acl: tuple[str, str, str]) -> None:
    url, ns_a, _ = acl
    async with ac.AsyncKVCache(ac.connect(url), namespace=ns_a, on_error="raise") as cache:
        await cache.set_many({i: i * i for i in range(20)})
        assert await cache.get_many(range(20)) == {i: i * i for i in range(20)}
        await cache.delete(3)
        assert await cache.get(3, "deleted") == "deleted"
        await cache.client.ping()


def test_other_namespace_is_a_counted_failure_and_falls_back(acl: tuple[str, str, str]
                                                             ) -> None:
    url, _, ns_b = acl
    with ac.AsyncKVCacheMapDataPipe(Source(30), ac.connect(url), namespace=ns_b) as dp:
        assert [dp[i] for i in range(30)] == values(30)  # consumer-side reads refused
        assert dp.__getitems__([0, 1, 2]) == values(3)  # loop-thread reads refused
        dp.flush()  # the writes behind them: refused, or skipped while the node backs off
        stats = dp.stats()
    assert stats["hits"] == 0 and stats["unavailable"] >= 1
    assert stats["rejected"] + stats["skipped"] >= 1


@pytest.mark.anyio
async def test_refusals_in_raise_mode_name_the_permission(acl: tuple[str, str, str]) -> None:
    url, _, ns_b = acl
    async with ac.AsyncKVCache(ac.connect(url), namespace=ns_b, on_error="raise") as cache:
        with pytest.raises(ac.StoreUnavailable) as read:
            await cache.get(1)
        with pytest.raises(ac.StoreRejected) as write:
            await cache.set(1, "x")
    for info in (read, write):
        message = str(info.value)
        assert "lacks permission" in message and "NOPERM" in message
        assert "ac:<namespace>:*" in message and "ACL SETUSER" in message
        assert USER_PASSWORD not in message and USER_PASSWORD not in repr(info.value)


def test_refusal_on_the_consumer_path_names_the_permission(acl: tuple[str, str, str]) -> None:
    url, _, ns_b = acl
    with ac.AsyncKVCacheMapDataPipe(Source(5), ac.connect(url), namespace=ns_b,
                                    on_error="raise") as dp, pytest.raises(
                                        ac.StoreUnavailable, match="lacks permission"):
        dp[0]


def test_wrong_password_is_refused_credentials(acl: tuple[str, str, str]) -> None:
    url, ns_a, _ = acl
    wrong = url.replace(USER_PASSWORD, "not-the-password")
    with ac.AsyncKVCacheMapDataPipe(Source(10), ac.connect(wrong), namespace=ns_a) as dp:
        assert [dp[i] for i in range(10)] == values(10)
        assert dp.stats()["unavailable"] >= 1
    for read in (lambda dp: dp[0], lambda dp: dp.__getitems__([0])):  # both paths
        with ac.AsyncKVCacheMapDataPipe(Source(10), ac.connect(wrong), namespace=ns_a,
                                        on_error="raise") as dp, pytest.raises(
                                            ac.StoreUnavailable) as info:
            read(dp)
        message = str(info.value)
        assert "refused the credentials" in message and "WRONGPASS" in message
        assert "not-the-password" not in message and "***" in message
