"""connect(): every URL form, options, and errors that name the bad part."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import asynccache as ac


def test_redis_url_parts_are_honoured() -> None:
    c = ac.connect("redis://alice:s3cret@10.1.2.3:6380/4?timeout=0.25&max_batch=32")
    assert isinstance(c, ac.RedisClient)
    assert (c.host, c.port, c.db) == ("10.1.2.3", 6380, 4)
    assert (c.username, c.password) == ("alice", "s3cret")
    assert c.timeout == 0.25 and c.max_batch == 32 and not c.ssl


def test_defaults_and_tls() -> None:
    c = ac.connect("rediss://cache.internal")
    assert (c.port, c.db, c.ssl) == (6379, 0, True)


def test_password_never_in_repr_or_errors() -> None:
    c = ac.connect("redis://:hunter2@127.0.0.1:6379/0")
    assert c.password == "hunter2"
    assert "hunter2" not in repr(c) and "hunter2" not in c.safe_url
    with pytest.raises(ac.InvalidURL) as info:
        ac.connect("redis://:hunter2@127.0.0.1:notaport/0")
    assert "hunter2" not in str(info.value)


def test_unix_socket_url() -> None:
    c = ac.connect("unix:///run/redis/redis.sock?db=2")
    assert c.unix_socket_path == "/run/redis/redis.sock" and c.db == 2


def test_cluster_url() -> None:
    c = ac.connect("redis+cluster://h1:7000,h2:7001")
    assert isinstance(c, ac.RedisClusterClient)
    assert c.nodes == [("h1", 7000), ("h2", 7001)]


@pytest.mark.parametrize(("valkey", "redis"), [
    ("valkey://alice:pw@h:6380/2?timeout=0.5", "redis://alice:pw@h:6380/2?timeout=0.5"),
    ("valkeys://h/0", "rediss://h/0"),
    ("valkey+cluster://h1:7000,h2:7001", "redis+cluster://h1:7000,h2:7001"),
    ("VALKEYS+CLUSTER://h1:7000", "rediss+cluster://h1:7000"),
])
def test_valkey_urls_are_the_redis_ones(valkey: str, redis: str) -> None:
    a, b = ac.connect(valkey), ac.connect(redis)
    assert type(a) is type(b) and pickle.dumps(a) == pickle.dumps(b)


def test_a_valkey_url_reaches_a_valkey_server(valkey_server: Any, namespace: str) -> None:
    url = valkey_server.url.replace("redis://", "valkey://", 1)
    with ac.AsyncKVCacheMapDataPipe(list(range(20)), ac.connect(url),
                                    namespace=namespace) as dp:
        assert [dp[i] for i in range(20)] == list(range(20))
    with ac.AsyncKVCacheMapDataPipe(list(range(20)), ac.connect(valkey_server.url),
                                    namespace=namespace) as again:
        assert again.__getitems__(list(range(20))) == list(range(20))
        assert again.stats()["hits"] == 20  # the same server, the same keys


def test_memcached_pool_url_and_item_size() -> None:
    c = ac.connect("memcached://a:11211,b,c:11300?item_size=8388608")
    assert isinstance(c, ac.MemcachedClient)
    assert c.servers == [("a", 11211), ("b", 11211), ("c", 11300)]
    assert c.max_value_size is not None and 8_000_000 < c.max_value_size < 8388608


def test_keyword_options_override_query() -> None:
    c = ac.connect("redis://h/0?timeout=5", timeout=0.1)
    assert c.timeout == 0.1
    assert ac.connect("redis://h/0?timeout=5", timeout=None).timeout == 5  # None: not given
    pool = ac.connect("memcached://a,b", item_size=2 << 20, max_batch=16)
    assert pool.max_batch == 16 and pool.max_value_size is not None \
        and pool.max_value_size > 1 << 20


def test_the_options_are_typed_keyword_only_parameters() -> None:
    """The reference and an editor show every option (it was ``**options: Any``)."""
    import inspect

    params = inspect.signature(ac.connect).parameters
    for name in ("timeout", "connect_timeout", "max_batch", "item_size", "tls",
                 "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
                 "ssl_check_hostname", "password_env"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default is None and "None" in str(params[name].annotation), name
    assert "timeout:" in (ac.connect.__doc__ or "") and "item_size:" in (ac.connect.__doc__ or "")


def test_memory_url() -> None:
    assert isinstance(ac.connect("memory://"), ac.MemoryClient)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://h:99999/0", "99999"),
        ("redis://h:port/0", "'port'"),
        ("redis://h:6379/x", "'x'"),
        ("ftp://h/", "'ftp'"),
        ("localhost:6379", "not a store URL"),
        ("redis://h1:1,h2:2", "redis+cluster"),
        ("memcached://", "names no server"),
        ("unix://", "socket path"),
        ("redis://h/0?colour=blue", "'colour'"),
        ("redis://h/0?timeout=soon", "timeout"),
    ],
)
def test_bad_urls_raise_invalid_url_naming_the_part(url: str, fragment: str) -> None:
    with pytest.raises(ac.InvalidURL) as info:
        ac.connect(url)
    assert fragment in str(info.value)
    assert isinstance(info.value, ac.CacheError)


def test_unknown_keyword_option_is_a_config_error() -> None:
    with pytest.raises(ac.ConfigError, match="colour"):
        ac.connect("redis://h/0", colour="blue")


@pytest.mark.parametrize(
    "url", ["redis://u:p@h:1/3", "memcached://a:1,b:2", "redis+cluster://a:1", "unix:///x.sock"]
)
def test_clients_pickle_as_configuration(url: str) -> None:
    c = ac.connect(url)
    clone = pickle.loads(pickle.dumps(c))
    assert type(clone) is type(c)
    assert clone.safe_url == c.safe_url
    assert clone.__getstate__() == c.__getstate__()
