"""Fixtures: real stores started once per test session on free ports / unix sockets.

A missing server binary is an *error* (ServerNotFound), never a skip: CI must fail when
the machine lacks a store.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import asynccache as ac
from asynccache.testing import servers

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



# -- TLS ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TlsCerts:
    """Certificates made by trustme for the TLS tests, as files in a temp dir."""

    server: servers.TlsFiles  # 127.0.0.1 and localhost, client certificates not required
    mutual: servers.TlsFiles  # the same, client certificates required
    wrong_host: servers.TlsFiles  # a certificate for cache.invalid only, same CA
    client_cert: str
    client_key: str
    untrusted_ca: str  # a CA that signed none of these


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> TlsCerts:
    import trustme  # the test extra's; an error, not a skip, when it is missing

    root = tmp_path_factory.mktemp("tls")
    ca, other = trustme.CA(), trustme.CA()

    def write(name: str, blob: Any) -> str:
        path = root / name
        blob.write_to_path(str(path))
        return str(path)

    ca_path = write("ca.pem", ca.cert_pem)
    server = ca.issue_cert("127.0.0.1", "localhost")
    wrong = ca.issue_cert("cache.invalid")
    client = ca.issue_cert("asynccache-client@example.invalid")
    server_cert, server_key = write("server.pem", server.cert_chain_pems[0]), write(
        "server.key", server.private_key_pem)
    client_cert, client_key = write("client.pem", client.cert_chain_pems[0]), write(
        "client.key", client.private_key_pem)
    plain = servers.TlsFiles(ca_path, server_cert, server_key, client_cert, client_key)
    return TlsCerts(
        server=plain,
        mutual=servers.TlsFiles(ca_path, server_cert, server_key, client_cert, client_key,
                                require_client_cert=True),
        wrong_host=servers.TlsFiles(ca_path, write("wrong.pem", wrong.cert_chain_pems[0]),
                                    write("wrong.key", wrong.private_key_pem)),
        client_cert=client_cert,
        client_key=client_key,
        untrusted_ca=write("untrusted-ca.pem", other.cert_pem),
    )


@pytest.fixture(scope="session")
def tls_redis(tls_certs: TlsCerts) -> Iterator[servers.RedisServer]:
    """A redis serving TLS only, verified against the test CA (no client certificate)."""
    with servers.start_redis(prefer="redis", tls=tls_certs.server) as server:
        yield server


@pytest.fixture(scope="session")
def tls_memcached(tls_certs: TlsCerts) -> Iterator[servers.MemcachedServer]:
    with servers.start_memcached(tls=tls_certs.server) as server:
        yield server


# -- credentials ----------------------------------------------------------------------------
#: a password with characters that URLs quote, so leak checks look for both spellings
SERVER_PASSWORD = "s3cret/Pa55@asynccache%"


@pytest.fixture(scope="session")
def password_redis() -> Iterator[servers.RedisServer]:
    """A redis whose default user needs SERVER_PASSWORD (``requirepass``)."""
    with servers.start_redis(prefer="redis", password=SERVER_PASSWORD) as server:
        yield server


# -- datasets that record what they compute (any process: appends to a file) -------------
def record_computation(log: str | os.PathLike[str], index: int) -> None:
    """Append ``index`` to ``log``: one ``write`` of one line, so lines of concurrent
    processes (DataLoader workers) never interleave."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, b"%d\n" % index)
    finally:
        os.close(fd)


def computed(log: str | os.PathLike[str]) -> list[int]:
    """The indices recorded in ``log`` so far, in the order they were computed."""
    path = Path(log)
    return [int(x) for x in path.read_text().split()] if path.exists() else []
