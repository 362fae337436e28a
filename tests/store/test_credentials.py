"""Passwords never leak: not in reprs, safe_url, log records, exception chains or pickles;
and processes that unpickle a client still find the password (fork, spawn,
password_env), or are told how to provide it."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
from torch.utils.data import DataLoader

import asynccache as ac
from asynccache.store.credentials import CREDENTIALS_ENV_PREFIX
from asynccache.testing import servers
from conftest import SERVER_PASSWORD, TlsCerts

SECRETS = (SERVER_PASSWORD, quote(SERVER_PASSWORD, safe=""), "other-Secret-4-acl")


def leaked(text: str | bytes) -> list[str]:
    blob = text.encode() if isinstance(text, str) else text
    return [s for s in SECRETS if s.encode() in blob]


def chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]


def assert_clean_exception(exc: BaseException) -> None:
    """No secret in the message, repr, args or rendered traceback of any exception in the
    chain (redis-py's, hiredis', ssl's and OS errors included)."""
    texts = ["".join(traceback.format_exception(exc))]
    for e in chain(exc):
        texts += [str(e), repr(e), repr(e.args)]
    assert not leaked("\n".join(texts)), "\n".join(texts)


class Source(torch.utils.data.Dataset):
    """Items whose computation is logged to a file shared by every process."""

    def __init__(self, n: int, log: str | None = None) -> None:
        self.n = n
        self.log = log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[str, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{index}\n")
        return ("c", index)


def urls(server: servers.RedisServer) -> list[str]:
    pw = quote(SERVER_PASSWORD, safe="")
    return [server.url, f"redis://someone:{pw}@127.0.0.1:{server.port}/1",
            f"unix://:{pw}@/tmp/redis.sock?db=2", f"redis+cluster://:{pw}@127.0.0.1:1,h:2",
            f"rediss://:{pw}@127.0.0.1:{server.port}/0"]


# -- pickles, reprs ------------------------------------------------------------------------
def test_pickles_and_reprs_carry_no_password(password_redis: servers.RedisServer) -> None:
    for url in urls(password_redis):
        client = ac.connect(url)
        assert client.password == SERVER_PASSWORD  # known in this process...
        blob = pickle.dumps(client)
        assert not leaked(blob), url  # ...and not in the pickle
        assert not leaked(repr(client)) and not leaked(client.safe_url)
        assert not leaked(repr(vars(client)))
        assert "***" in client.safe_url
        clone = pickle.loads(blob)
        assert clone.password == SERVER_PASSWORD and clone.safe_url == client.safe_url
    client = ac.connect(password_redis.url)
    dp = ac.AsyncKVCacheMapDataPipe(Source(10), client, namespace="cred-pickle")
    try:
        assert dp[0] == ("c", 0)
        assert not leaked(pickle.dumps(dp)) and not leaked(repr(dp))
        assert str(dp) == repr(dp) and "namespace='cred-pickle'" in str(dp)  # print(dp)
    finally:
        dp.close()
    cache = ac.AsyncKVCache(client, namespace="cred-pickle")
    assert not leaked(repr(cache))
    # a cache belongs to its event loop and is not picklable; its error leaks nothing
    with pytest.raises(TypeError) as info:
        pickle.dumps(cache)
    assert_clean_exception(info.value)


def test_same_url_with_two_passwords_keeps_both(password_redis: servers.RedisServer) -> None:
    right = ac.connect(password_redis.url)
    wrong = ac.connect(password_redis.url.replace(quote(SERVER_PASSWORD, safe=""), "nope"))
    assert right.safe_url == wrong.safe_url
    assert right._credential != wrong._credential
    assert right.password == SERVER_PASSWORD and wrong.password == "nope"
    assert pickle.loads(pickle.dumps(right)).password == SERVER_PASSWORD


# -- other processes ------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_find_the_password(password_redis: servers.RedisServer,
                                              tmp_path: Path, method: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """spawn: fresh interpreters, found through the exported variable; fork: inherited
    vault (the variable is removed first, so nothing else could provide it)."""
    client = ac.connect(password_redis.url, timeout=10)
    variable = CREDENTIALS_ENV_PREFIX + client._credential.fingerprint
    assert os.environ[variable] == SERVER_PASSWORD
    if method == "fork":
        monkeypatch.delenv(variable)
    log = tmp_path / "computed"
    dp = ac.AsyncKVCacheMapDataPipe(Source(64, str(log)), client,
                                    namespace=f"cred-dl-{method}", prefetch=16)
    try:
        dp.__getitems__(list(range(64)))
        dp.flush()
        log.unlink()  # the parent computed and cached every item
        loader = DataLoader(dp, batch_size=8, num_workers=2, multiprocessing_context=method,
                            collate_fn=list)
        seen = sorted(item[1] for batch in loader for item in batch)
    finally:
        dp.close()
    assert seen == list(range(64))
    assert not log.exists(), "a spawned worker computed items: it could not read the cache"


async def read_and_close(client: ac.BaseClient) -> list[bytes | None]:
    try:
        return await client.get_many([b"cred:k"])
    finally:
        await client.close()


CHILD = """
import asyncio, os, pickle, sys
import asynccache as ac

async def read(client):
    try:
        print("ok", await client.get_many([b"cred:k"]))
    except ac.ConfigError as exc:
        print("ConfigError:", exc)
    finally:
        await client.close()

for path in sys.argv[1:]:
    if path.endswith("unset"):
        del os.environ["ASYNCCACHE_TEST_PASSWORD"]
    client = pickle.load(open(path, "rb"))
    asyncio.run(read(client))
    try:
        client.consumer_reads()
        print("consumer ok")
    except ac.ConfigError as exc:
        print("consumer ConfigError:", exc)
"""


def test_fresh_process_and_password_env(password_redis: servers.RedisServer, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    password_redis.call("SET", "cred:k", "v")
    exported = {k for k in os.environ if k.startswith(CREDENTIALS_ENV_PREFIX)}
    monkeypatch.setenv("ASYNCCACHE_TEST_PASSWORD", SERVER_PASSWORD)
    bare = f"redis://127.0.0.1:{password_redis.port}/0"
    by_env = ac.connect(f"{bare}?password_env=ASYNCCACHE_TEST_PASSWORD")
    assert ac.connect(bare, password_env="ASYNCCACHE_TEST_PASSWORD").password == SERVER_PASSWORD
    assert {k for k in os.environ if k.startswith(CREDENTIALS_ENV_PREFIX)} == exported
    assert "***" in by_env.safe_url and not leaked(pickle.dumps(by_env))
    assert asyncio.run(read_and_close(by_env)) == [b"v"]

    paths = []
    for name, client in (("vault", ac.connect(password_redis.url)), ("env", by_env),
                         ("env-unset", by_env)):
        paths.append(tmp_path / name)
        paths[-1].write_bytes(pickle.dumps(client))
    env = {k: v for k, v in os.environ.items() if not k.startswith(CREDENTIALS_ENV_PREFIX)}
    done = subprocess.run([sys.executable, "-c", CHILD, *map(str, paths)], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    lines = done.stdout.splitlines()
    assert not leaked(done.stdout + done.stderr)
    # a fresh process without the exported variable: told how to provide the password
    assert lines[0].startswith("ConfigError:") and "password_env" in lines[0]
    assert CREDENTIALS_ENV_PREFIX in lines[0]
    assert lines[1].startswith("consumer ConfigError:")
    # password_env: read in the child from its own environment
    assert lines[2:4] == ["ok [b'v']", "consumer ok"]
    assert lines[4].startswith("ConfigError:") and "ASYNCCACHE_TEST_PASSWORD" in lines[4]


def test_password_env_mistakes_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCCACHE_UNSET_VARIABLE", raising=False)
    with pytest.raises(ac.ConfigError, match=r"ASYNCCACHE_UNSET_VARIABLE.*not set"):
        ac.connect("redis://h:1/0?password_env=ASYNCCACHE_UNSET_VARIABLE")
    monkeypatch.setenv("ASYNCCACHE_TEST_PASSWORD", "x")
    with pytest.raises(ac.ConfigError, match="not both") as info:
        ac.connect(f"redis://:{SECRETS[1]}@h:1/0?password_env=ASYNCCACHE_TEST_PASSWORD")
    assert_clean_exception(info.value)
    with pytest.raises(ac.ConfigError, match="not an environment variable name"):
        ac.connect("redis://h:1/0", password_env="not a name")
    with pytest.raises(ac.ConfigError):
        ac.connect("memcached://h:1", password_env="ASYNCCACHE_TEST_PASSWORD")


# -- failures: messages, chains and logs -----------------------------------------------------
@pytest.fixture
def failing_urls(password_redis: servers.RedisServer, tls_redis: servers.RedisServer,
                 redis_cluster: servers.RedisCluster, tls_certs: TlsCerts) -> Iterable[str]:
    """URLs that fail with a password in them: wrong password, NOPERM, TLS, cluster."""
    pw = quote(SERVER_PASSWORD, safe="")
    password_redis.call("ACL", "SETUSER", "cred-user", "reset", "on", ">other-Secret-4-acl",
                        "~ac:elsewhere:*", "+mget", "+set", "+del", "+ping")
    cluster_node = redis_cluster.nodes[0]
    yield [
        password_redis.url.replace(pw, quote(SECRETS[2])),  # wrong password
        f"redis://cred-user:other-Secret-4-acl@127.0.0.1:{password_redis.port}/0",  # NOPERM
        f"rediss://:{pw}@127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={tls_certs.untrusted_ca}",
        f"redis+cluster://:{pw}@127.0.0.1:{cluster_node.port}",  # AUTH refused by each node
    ]
    password_redis.call("ACL", "DELUSER", "cred-user")


def test_failures_leak_no_password(failing_urls: list[str], caplog: pytest.LogCaptureFixture
                                   ) -> None:
    caplog.set_level(logging.DEBUG, logger="asynccache")
    for url in failing_urls:
        client = ac.connect(url)
        with ac.AsyncKVCacheMapDataPipe(Source(8), client, namespace="cred-fail") as dp:
            assert [dp[i] for i in range(8)] == [("c", i) for i in range(8)]
            assert dp.__getitems__([0, 1]) == [("c", 0), ("c", 1)]
            assert dp.stats()["errors"] >= 1, url
            assert not leaked(repr(dp))
        for read in (lambda dp: dp[0], lambda dp: dp.__getitems__([1, 2])):
            with ac.AsyncKVCacheMapDataPipe(Source(8), ac.connect(url), namespace="cred-fail",
                                            on_error="raise") as dp, pytest.raises(
                                                ac.StoreError) as info:
                read(dp)
            assert_clean_exception(info.value)
    records = caplog.records
    assert records, "the failures were logged"
    for record in records:
        text = record.getMessage() + (record.exc_text or "")
        if record.exc_info and record.exc_info[1] is not None:
            assert_clean_exception(record.exc_info[1])
        assert not leaked(text), text
    assert not leaked(caplog.text)
