"""Errors that name the fix: a URL of the wrong protocol or without TLS says which URL to
use, and the node is backed off like any node that cannot serve (one failure logged,
the rest skipped: not one error per item); ``lmdb://relative/path`` is a ConfigError
naming the three-slash form; the documentation's examples write under a temp or home
directory.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

import asynccache as ac
from asynccache.testing import servers

N = 1000


def through_a_pipe(url: str, caplog: pytest.LogCaptureFixture) -> tuple[dict[str, int], str]:
    """Read N items through a pipe (read-ahead on the consumer's socket, writes through
    the loop): the pipe's stats and what was logged at WARNING."""
    caplog.clear()
    client = ac.connect(url, timeout=1)
    with caplog.at_level(logging.WARNING, logger="asynccache"), \
            ac.AsyncKVCacheMapDataPipe(list(range(N)), client, namespace="wrong-url") as dp:
        assert [dp[i] for i in range(N)] == list(range(N))  # the cache is an optimisation
        stats = dp.stats()
    return stats, "\n".join(r.getMessage() for r in caplog.records)


def raised(url: str) -> ac.CacheError:
    """What the asyncio core raises (on_error="raise") for a read and for a write."""
    async def body() -> list[ac.CacheError]:
        found = []
        async with ac.AsyncKVCache(ac.connect(url, timeout=1), namespace="wrong-url",
                                   on_error="raise") as cache:
            for op in (cache.get_many(["a", "b"]), cache.set("a", 1)):
                with pytest.raises(ac.CacheError) as info:
                    await op
                found.append(info.value)
        return found

    read, write = asyncio.run(body())
    assert type(read) is type(write) and str(read).split(":")[0] == str(write).split(":")[0]
    return read


def assert_backed_off(stats: dict[str, int]) -> None:
    # before: 1,957 errors for 1,000 items (no back-off); now one failure per back-off
    # period (0.5 s, doubling), whatever the machine's speed: far fewer than the items
    assert stats["unavailable"] >= 1 and stats["skipped"] > 0
    assert stats["errors"] < N // 10, stats


def test_redis_url_at_a_memcached_port_says_use_memcached(
        memcached_server: servers.MemcachedServer, caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://127.0.0.1:{memcached_server.port}/0"
    error = raised(url)
    assert isinstance(error, ac.StoreUnavailable)
    assert "looks like a memcached server" in str(error)
    assert f"memcached://127.0.0.1:{memcached_server.port}" in str(error)
    assert "item_size" not in str(error)
    stats, log = through_a_pipe(url, caplog)
    assert_backed_off(stats)
    assert "looks like a memcached server" in log and "Protocol error" not in log


def test_redis_cluster_url_at_a_memcached_port_says_use_memcached(
        memcached_server: servers.MemcachedServer) -> None:
    error = raised(f"redis+cluster://127.0.0.1:{memcached_server.port}")
    assert isinstance(error, ac.StoreUnavailable)
    assert "looks like a memcached server" in str(error)


def test_memcached_url_at_a_redis_port_says_use_redis(
        redis_server: servers.RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    url = f"memcached://127.0.0.1:{redis_server.port}"
    error = raised(url)
    assert isinstance(error, ac.StoreUnavailable)
    assert "looks like a Redis server" in str(error)
    assert f"redis://127.0.0.1:{redis_server.port}/0" in str(error)
    assert "item_size" not in str(error)  # the old, misleading hint
    stats, log = through_a_pipe(url, caplog)
    assert_backed_off(stats)
    assert "looks like a Redis server" in log and "item_size" not in log


def test_redis_url_at_a_tls_port_suggests_rediss(
        tls_redis: servers.RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://127.0.0.1:{tls_redis.port}/0"
    error = raised(url)
    assert isinstance(error, ac.StoreUnavailable)
    assert "rediss://" in str(error)
    stats, log = through_a_pipe(url, caplog)
    assert_backed_off(stats)
    assert "rediss://" in log


def test_memcached_url_at_a_tls_port_suggests_tls_true(
        tls_memcached: servers.MemcachedServer, caplog: pytest.LogCaptureFixture) -> None:
    url = f"memcached://127.0.0.1:{tls_memcached.port}"
    error = raised(url)
    assert isinstance(error, ac.StoreUnavailable)
    assert "tls=true" in str(error)
    stats, log = through_a_pipe(url, caplog)
    assert_backed_off(stats)
    assert "tls=true" in log


def test_a_plain_server_that_answered_gets_no_tls_hint() -> None:
    """The hint is for a connection closed before any answer, not for every close."""
    async def body(server: servers.RedisServer) -> str:
        client = ac.connect(server.url, timeout=1)
        async with ac.AsyncKVCache(client, namespace="restart", on_error="raise") as cache:
            await cache.set("a", 1)
            server.kill()
            with pytest.raises(ac.StoreUnavailable) as info:
                await cache.get_many(["a"])
            return str(info.value)

    with servers.start_redis() as server:
        assert "rediss://" not in asyncio.run(body(server))


def test_lmdb_with_two_slashes_is_a_config_error_naming_three(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ac.ConfigError) as info:
        ac.connect("lmdb://relative/path")
    message = str(info.value)
    assert "lmdb:///abs/path" in message and "three slashes" in message
    assert f"lmdb://{tmp_path}/relative/path" in message
    assert not (tmp_path / "relative").exists()  # nothing made relative to the cwd


def test_readme_examples_write_under_a_temp_or_home_directory() -> None:
    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert "/scratch" not in text, page
        assert 'ac.connect("lmdb:///' not in text, page  # no fixed directory at the root
    assert "Path.home()" in (root / "docs" / "stores.md").read_text()


async def _write_error(url: str, value: bytes) -> ac.StoreTimeout:
    async with ac.AsyncKVCache(ac.connect(url, timeout=1), namespace="timeout-hint",
                               on_error="raise") as cache:
        with pytest.raises(ac.StoreTimeout) as info:
            await cache.set("k", value)
    return info.value


def test_a_write_timeout_blames_the_size_only_of_a_large_value(
        redis_server: servers.RedisServer) -> None:
    """A frozen store: a 77-byte value is not "too large for the link". A link of 200 kB/s:
    a 1 MiB value alone outlasts timeout=1s, and the message says so (with its size)."""
    from asynccache.testing.proxy import FaultProxy, url_through

    with FaultProxy(redis_server.host, redis_server.port) as proxy:
        url = url_through(proxy, redis_server.url)
        proxy.set_blackhole(True)
        small = str(asyncio.run(_write_error(url, b"x" * 77)))
        assert "did not answer within 1s" in small and "raise `timeout=`" in small
        assert "MiB" not in small and "KiB" not in small and "link" not in small
        proxy.set_blackhole(False)
        proxy.set_trickle(20_000, 0.1, direction="up")
        large = str(asyncio.run(_write_error(url, b"x" * (1 << 20))))
        assert "one value of 1.0 MiB" in large and "raise timeout=" in large


SHADOWED = '''
import importlib.machinery, sys
import asynccache as ac

class OnlyTheDirectory:  # as if the lmdb package were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "lmdb":
            return importlib.machinery.PathFinder.find_spec(name, ["."])
        return None

sys.meta_path.insert(0, OnlyTheDirectory())
for _ in range(2):  # the same answer the second time
    try:
        ac.AsyncKVCacheMapDataPipe([1], ac.connect("lmdb:///tmp/x"), namespace="n")[0]
    except ac.MissingDependency as exc:
        print(exc)
'''


def test_a_directory_named_lmdb_is_not_taken_for_the_package(tmp_path: Path) -> None:
    """Before: AttributeError (module 'lmdb' has no attribute 'open') when a directory
    named lmdb sits in the current directory and the package is not installed."""
    import subprocess
    import sys

    (tmp_path / "lmdb").mkdir()
    done = subprocess.run([sys.executable, "-c", SHADOWED], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert str(tmp_path / "lmdb") in lines[0] and "pip install 'asynccache[lmdb]'" in lines[0]
