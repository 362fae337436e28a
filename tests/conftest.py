"""Fixtures: real stores started once per test session on free ports / unix sockets.

A missing server binary is an *error* (ServerNotFound), never a skip: CI must fail when
the machine lacks a store.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator

import pytest

import asynccache as ac
from asynccache import servers

BACKENDS = ["redis", "redis-unix", "valkey", "memcached", "memcached-pool", "cluster"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[servers.RedisServer]:
    with servers.start_redis(prefer="redis") as server:
        yield server


@pytest.fixture(scope="session")
def redis_unix_server() -> Iterator[servers.RedisServer]:
    with servers.start_redis(prefer="redis", unix_socket=True) as server:
        yield server


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[servers.RedisServer]:
    with servers.start_redis(prefer="embedded") as server:
        yield server


@pytest.fixture(scope="session")
def memcached_server() -> Iterator[servers.MemcachedServer]:
    with servers.start_memcached() as server:
        yield server


@pytest.fixture(scope="session")
def memcached_pool() -> Iterator[list[servers.MemcachedServer]]:
    with servers.start_memcached() as a, servers.start_memcached() as b:
        yield [a, b]


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[servers.RedisCluster]:
    with servers.start_redis_cluster(3) as cluster:
        yield cluster


def url_for(backend: str, request: pytest.FixtureRequest) -> str:
    if backend == "redis":
        return request.getfixturevalue("redis_server").url
    if backend == "redis-unix":
        return request.getfixturevalue("redis_unix_server").url
    if backend == "valkey":
        return request.getfixturevalue("valkey_server").url
    if backend == "memcached":
        return request.getfixturevalue("memcached_server").url
    if backend == "memcached-pool":
        pool = request.getfixturevalue("memcached_pool")
        return "memcached://" + ",".join(f"{s.host}:{s.port}" for s in pool)
    if backend == "cluster":
        return request.getfixturevalue("redis_cluster").url
    if backend == "memory":
        return "memory://tests"
    raise AssertionError(backend)


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest) -> str:
    """The URL of each real backend in turn."""
    return url_for(request.param, request)


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    """A namespace unique to the test, so tests sharing a server never see each other."""
    return "t-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    return request.param


@pytest.fixture
async def client(store_url: str) -> AsyncIterator[ac.BaseClient]:
    c = ac.connect(store_url)
    yield c
    await c.close()

