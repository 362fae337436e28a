"""TLS on real servers: Redis and memcached, the asyncio path and the consumer-side path,
client certificates, verification failures, deadlines through a slow link, options."""

from __future__ import annotations

import pickle
import select
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

import asynccache as ac
from asynccache.store.transport.endpoint import wait_ready
from asynccache.testing import servers
from asynccache.testing.proxy import FaultProxy, url_through
from conftest import TlsCerts


class Source:
    """Values a test can recognise: ``("v", i, padding)``."""

    def __init__(self, n: int, size: int = 0) -> None:
        self.n = n
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[str, int, bytes]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return ("v", index, b"x" * self.size)


def with_options(url: str, **options: str) -> str:
    extra = "&".join(f"{k}={quote(v, safe='/')}" for k, v in options.items())
    return f"{url}{'&' if '?' in url else '?'}{extra}"


def read_twice(url: str, namespace: str, n: int = 300) -> dict[str, int]:
    """Fill through one pipe, read back sequentially through a second: its stats."""
    with ac.AsyncKVCacheMapDataPipe(Source(n), ac.connect(url), namespace=namespace) as dp:
        assert [dp[i][1] for i in range(n)] == list(range(n))
    with ac.AsyncKVCacheMapDataPipe(Source(n), ac.connect(url), namespace=namespace) as dp:
        assert [dp[i] for i in range(n)] == [Source(n)[i] for i in range(n)]
        return dp.stats()


@pytest.fixture(scope="module")
def mutual_redis(tls_certs: TlsCerts) -> Iterator[servers.RedisServer]:
    with servers.start_redis(prefer="redis", tls=tls_certs.mutual) as server:
        yield server


@pytest.fixture(scope="module")
def wrong_host_redis(tls_certs: TlsCerts) -> Iterator[servers.RedisServer]:
    with servers.start_redis(prefer="redis", tls=tls_certs.wrong_host) as server:
        yield server


# -- data over TLS ----------------------------------------------------------------------
@pytest.mark.anyio
async def test_async_cache_over_rediss(tls_redis: servers.RedisServer, namespace: str) -> None:
    assert tls_redis.url.startswith("rediss://") and "ssl_ca_certs=" in tls_redis.url
    client = ac.connect(tls_redis.url)
    async with ac.AsyncKVCache(client, namespace=namespace) as cache:
        await cache.set_many({i: ("v", i) for i in range(50)})
        assert await cache.get_many(range(50)) == {i: ("v", i) for i in range(50)}
        await cache.delete(0)
        assert await cache.get(0, "gone") == "gone"
        stats = cache.stats()
    assert stats["hits"] == 50 and stats["misses"] == 1 and stats["errors"] == 0


def test_pipe_reads_ahead_on_its_own_tls_socket(tls_redis: servers.RedisServer,
                                                namespace: str) -> None:
    reads = ac.connect(tls_redis.url).consumer_reads()
    assert reads is not None  # TLS reads no longer go through the loop thread
    stats = read_twice(tls_redis.url, namespace)
    assert stats["hits"] == 300 and stats["errors"] == 0
    assert stats["prefetch_hits"] > 0 and stats["direct_reads"] <= 2


def test_client_certificate_required(mutual_redis: servers.RedisServer, tls_certs: TlsCerts,
                                     namespace: str) -> None:
    assert "ssl_certfile=" in mutual_redis.url
    stats = read_twice(mutual_redis.url, namespace, 100)
    assert stats["hits"] == 100 and stats["prefetch_hits"] > 0
    anonymous = f"rediss://127.0.0.1:{mutual_redis.port}/0?ssl_ca_certs={tls_certs.server.ca_cert}"
    with ac.AsyncKVCacheMapDataPipe(Source(20), ac.connect(anonymous), namespace=namespace,
                                    on_error="raise") as dp, pytest.raises(
                                        ac.StoreUnavailable, match=r"(?i)certificate"):
        dp[0]
    with ac.AsyncKVCacheMapDataPipe(Source(20), ac.connect(anonymous),
                                    namespace=namespace) as dp:
        assert [dp[i] for i in range(20)] == [Source(20)[i] for i in range(20)]
        assert dp.stats()["unavailable"] >= 1


@pytest.mark.anyio
async def test_memcached_over_tls_asyncio(tls_memcached: servers.MemcachedServer,
                                          namespace: str) -> None:
    assert "tls=true" in tls_memcached.url
    async with ac.AsyncKVCache(ac.connect(tls_memcached.url), namespace=namespace) as cache:
        await cache.set_many({i: ("m", i) for i in range(40)})
        assert await cache.get_many(range(40)) == {i: ("m", i) for i in range(40)}
        assert cache.stats()["errors"] == 0


def test_memcached_over_tls_consumer_reads(tls_memcached: servers.MemcachedServer,
                                           namespace: str) -> None:
    stats = read_twice(tls_memcached.url, namespace)
    assert stats["hits"] == 300 and stats["prefetch_hits"] > 0 and stats["errors"] == 0


@pytest.fixture(scope="module")
def tls_cluster(tls_certs: TlsCerts) -> Iterator[servers.RedisCluster]:
    with servers.start_redis_cluster(3, tls=tls_certs.server) as cluster:
        yield cluster


@pytest.mark.anyio
async def test_cluster_over_tls(tls_cluster: servers.RedisCluster, namespace: str) -> None:
    assert tls_cluster.url.startswith("rediss+cluster://")
    client = ac.connect(tls_cluster.url)
    async with ac.AsyncKVCache(client, namespace=namespace) as cache:
        await cache.set_many({i: ("c", i) for i in range(200)})  # keys on every node
        assert await cache.get_many(range(200)) == {i: ("c", i) for i in range(200)}
        assert cache.stats()["errors"] == 0
        assert len(client.node_names) == 3


def test_cluster_pipe_over_tls_and_an_untrusted_ca(tls_cluster: servers.RedisCluster,
                                                   tls_certs: TlsCerts,
                                                   namespace: str) -> None:
    stats = read_twice(tls_cluster.url, namespace, 100)
    assert stats["hits"] == 100 and stats["errors"] == 0
    hosts = tls_cluster.url.partition("://")[2].partition("?")[0]
    untrusted = f"rediss+cluster://{hosts}?ssl_ca_certs={tls_certs.untrusted_ca}"
    with ac.AsyncKVCacheMapDataPipe(Source(10), ac.connect(untrusted), namespace=namespace,
                                    on_error="raise") as dp, pytest.raises(
                                        ac.StoreUnavailable,
                                        match=r"TLS verification failed.*ssl_ca_certs"):
        dp[0]
    with ac.AsyncKVCacheMapDataPipe(Source(10), ac.connect(untrusted),
                                    namespace=namespace) as dp:
        assert [dp[i] for i in range(10)] == [Source(10)[i] for i in range(10)]
        assert dp.stats()["unavailable"] >= 1


# -- verification failures --------------------------------------------------------------
def untrusted_url(server: servers.RedisServer, certs: TlsCerts) -> str:
    return f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={certs.untrusted_ca}"


def test_untrusted_certificate_falls_back_on_both_paths(tls_redis: servers.RedisServer,
                                                        tls_certs: TlsCerts,
                                                        namespace: str) -> None:
    url = untrusted_url(tls_redis, tls_certs)
    with ac.AsyncKVCacheMapDataPipe(Source(30), ac.connect(url), namespace=namespace) as dp:
        assert [dp[i] for i in range(30)] == [Source(30)[i] for i in range(30)]  # consumer
        assert dp.__getitems__([0, 1]) == [Source(30)[0], Source(30)[1]]  # loop thread
        stats = dp.stats()
    assert stats["unavailable"] >= 1 and stats["hits"] == 0


@pytest.mark.anyio
async def test_untrusted_certificate_raises_naming_ssl_ca_certs(
        tls_redis: servers.RedisServer, tls_certs: TlsCerts, namespace: str) -> None:
    client = ac.connect(untrusted_url(tls_redis, tls_certs))
    async with ac.AsyncKVCache(client, namespace=namespace, on_error="raise") as cache:
        with pytest.raises(ac.StoreUnavailable) as info:
            await cache.get(1)
    message = str(info.value)
    assert "TLS verification failed" in message and tls_certs.untrusted_ca in message
    assert "ssl_ca_certs" in message
    assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)


def test_untrusted_certificate_raises_on_the_consumer_path(tls_redis: servers.RedisServer,
                                                           tls_certs: TlsCerts,
                                                           namespace: str) -> None:
    client = ac.connect(untrusted_url(tls_redis, tls_certs))
    with ac.AsyncKVCacheMapDataPipe(Source(5), client, namespace=namespace,
                                    on_error="raise") as dp, pytest.raises(
                                        ac.StoreUnavailable,
                                        match=r"TLS verification failed.*ssl_ca_certs"):
        dp[0]


def test_wrong_hostname(wrong_host_redis: servers.RedisServer, tls_certs: TlsCerts,
                        namespace: str) -> None:
    url = wrong_host_redis.url  # trusts the CA; the certificate names cache.invalid only
    with ac.AsyncKVCacheMapDataPipe(Source(10), ac.connect(url), namespace=namespace,
                                    on_error="raise") as dp, pytest.raises(
                                        ac.StoreUnavailable, match="TLS verification failed"
                                    ) as info:
        dp[0]
    assert "ssl_check_hostname" in str(info.value) and "ssl_ca_certs" in str(info.value)
    with ac.AsyncKVCacheMapDataPipe(Source(10), ac.connect(url), namespace=namespace) as dp:
        assert [dp[i] for i in range(10)] == [Source(10)[i] for i in range(10)]
        assert dp.stats()["unavailable"] >= 1
    relaxed = with_options(url, ssl_check_hostname="false")  # still verified against the CA
    stats = read_twice(relaxed, namespace, 50)
    assert stats["hits"] == 50 and stats["errors"] == 0


def test_plain_client_on_a_tls_port_and_tls_client_on_a_plain_port(
        tls_redis: servers.RedisServer, redis_server: servers.RedisServer,
        tls_certs: TlsCerts) -> None:
    reads = ac.connect(f"rediss://127.0.0.1:{redis_server.port}/0?ssl_ca_certs="
                       f"{tls_certs.server.ca_cert}", connect_timeout=0.3).consumer_reads()
    conn = reads.connections[0]
    with pytest.raises(ac.StoreTimeout, match=r"TLS handshake.*does not speak TLS"):
        conn.send_get([b"k"])  # redis waits for the end of a command line that never comes
    plain = ac.connect(f"redis://127.0.0.1:{tls_redis.port}/0", timeout=0.5).consumer_reads()
    conn = plain.connections[0]
    started = time.monotonic()
    with pytest.raises(ac.StoreError):
        conn.send_get([b"k"])
        conn.receive()
    assert time.monotonic() - started < 10.0  # bounded at all: a TLS port never answers


# -- deadlines over TLS -----------------------------------------------------------------
@pytest.fixture
def tls_proxy(tls_redis: servers.RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", tls_redis.port) as proxy:
        yield proxy


def test_latency_costs_one_timeout_over_tls(tls_proxy: FaultProxy,
                                            tls_redis: servers.RedisServer) -> None:
    client = ac.connect(url_through(tls_proxy, tls_redis.url), timeout=0.3)
    conn = client.consumer_reads().connections[0]
    conn.send_get([b"k"])
    assert conn.receive() == [None]  # connected, handshake done
    tls_proxy.set_latency(2.0)
    started = time.monotonic()
    conn.send_get([b"k"])
    with pytest.raises(ac.StoreTimeout):
        conn.receive()
    assert 0.25 < time.monotonic() - started < 1.8  # one 0.3 s timeout, not the fault's time


def test_slow_handshake_is_bounded_by_connect_timeout(tls_proxy: FaultProxy,
                                                      tls_redis: servers.RedisServer) -> None:
    tls_proxy.set_latency(2.0)
    client = ac.connect(url_through(tls_proxy, tls_redis.url), connect_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(ac.StoreTimeout, match="TLS handshake"):
        client.consumer_reads().connections[0].send_get([b"k"])
    assert time.monotonic() - started < 1.8  # the 0.3 s connect timeout, not the 2 s latency


def test_trickle_costs_one_timeout_over_tls(tls_proxy: FaultProxy,
                                            tls_redis: servers.RedisServer,
                                            namespace: str) -> None:
    keys = [f"{namespace}:{i}".encode() for i in range(20)]
    tls_redis.call("MSET", *[part for key in keys for part in (key, b"v" * 2000)])
    conn = ac.connect(url_through(tls_proxy, tls_redis.url),
                      timeout=0.3).consumer_reads().connections[0]
    conn.send_get(keys[:1])
    assert conn.receive() == [b"v" * 2000]
    tls_proxy.set_trickle(64, 0.1)  # 40 kB at 640 B/s: every read gets bytes, never a reply
    started = time.monotonic()
    conn.send_get(keys)
    with pytest.raises(ac.StoreTimeout):
        conn.receive()
    assert 0.25 < time.monotonic() - started < 1.8  # one 0.3 s timeout, not the fault's time


def test_pipe_over_a_trickling_tls_link_falls_back_in_time(tls_proxy: FaultProxy,
                                                           tls_redis: servers.RedisServer,
                                                           namespace: str) -> None:
    url = url_through(tls_proxy, tls_redis.url)
    with ac.AsyncKVCacheMapDataPipe(Source(40, 2000), ac.connect(url), namespace=namespace,
                                    prefetch=8) as dp:
        dp.__getitems__(list(range(40)))
        dp.flush()
    tls_proxy.set_trickle(64, 0.1)
    with ac.AsyncKVCacheMapDataPipe(Source(40, 2000), ac.connect(url, timeout=0.3),
                                    namespace=namespace, prefetch=8) as dp:
        started = time.monotonic()
        assert dp[0] == Source(40, 2000)[0]
        assert time.monotonic() - started < 10.0  # the trickle needs ~60 s for a reply
        assert dp.stats()["timeouts"] >= 1


# -- what pending() is for --------------------------------------------------------------
def test_bytes_held_by_the_ssl_object_count_as_readable(tls_redis: servers.RedisServer,
                                                        tls_certs: TlsCerts) -> None:
    """After a partial read the rest of the record sits decrypted in the SSL object and
    the socket is not readable: a bare poll() would wait for the deadline."""
    context = ssl.create_default_context(cafile=tls_certs.server.ca_cert)
    raw = socket.create_connection(("127.0.0.1", tls_redis.port), 2)
    with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        assert sock.recv(1) == b"+"  # the whole record was decrypted, one byte handed over
        assert sock.pending() == len(b"PONG\r\n")
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        assert poller.poll(100) == []  # the kernel has nothing more: poll alone would hang
        started = time.monotonic()
        assert wait_ready(sock, select.POLLIN, 10.0)
        assert time.monotonic() - started < 5.0  # not the 10 s the poll would wait


def test_a_readiness_check_does_not_wait(tls_redis: servers.RedisServer,
                                         tls_certs: TlsCerts) -> None:
    """The idle check runs before a send on an idle connection: on the hot path."""
    context = ssl.create_default_context(cafile=tls_certs.server.ca_cert)
    raw = socket.create_connection(("127.0.0.1", tls_redis.port), 2)
    with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        assert sock.recv(100) == b"+PONG\r\n"  # session tickets read on the way
        started = time.monotonic()
        assert not any(wait_ready(sock, select.POLLIN, 0) for _ in range(2000))
        assert time.monotonic() - started < 1.0  # not a millisecond each (2 s)


# -- options -------------------------------------------------------------------------------
def test_tls_options_from_the_url_and_keywords(tls_certs: TlsCerts) -> None:
    ca, cert, key = tls_certs.server.ca_cert, tls_certs.client_cert, tls_certs.client_key
    c = ac.connect(f"rediss://h:1/0?ssl_ca_certs={ca}&ssl_certfile={cert}&ssl_keyfile={key}"
                   "&ssl_cert_reqs=optional&ssl_check_hostname=false")
    assert c.tls is not None and c.ssl
    assert (c.tls.ca_certs, c.tls.certfile, c.tls.keyfile) == (ca, cert, key)
    assert (c.tls.cert_reqs, c.tls.check_hostname) == ("optional", False)
    kw = ac.connect("redis://h:1/0", tls=True, ssl_ca_certs=Path(ca), ssl_check_hostname=False)
    assert kw.tls is not None and kw.tls.ca_certs == ca and not kw.tls.check_hostname
    assert kw.safe_url.startswith("rediss://")
    cluster = ac.connect(f"rediss+cluster://a:1,b:2?ssl_ca_certs={ca}")
    assert cluster.tls is not None and cluster.safe_url.startswith("rediss+cluster://")
    assert ac.connect("redis+cluster://a:1?tls=true").tls is not None
    mc = ac.connect(f"memcached://a:1,b:2?tls=true&ssl_ca_certs={ca}")
    assert mc.tls is not None and mc.tls.ca_certs == ca and "tls=true" in mc.safe_url
    assert ac.connect("memcached://a:1").tls is None


@pytest.mark.parametrize(
    ("query", "error", "fragment"),
    [
        ("ssl_ca_certs=/nonexistent/ca.pem", ac.ConfigError, "ssl_ca_certs='/nonexistent"),
        ("ssl_cert_reqs=sometimes", ac.ConfigError, "ssl_cert_reqs"),
        ("ssl_check_hostname=perhaps", ac.InvalidURL, "ssl_check_hostname"),
        ("tls=false", ac.InvalidURL, "tls=false"),
        ("ssl_certfile=/nonexistent/c.pem", ac.ConfigError, "ssl_certfile"),
    ],
)
def test_bad_tls_options_name_the_option(query: str, error: type[Exception],
                                         fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        ac.connect(f"rediss://:secret@h:1/0?{query}")


def test_tls_files_that_are_not_what_they_should_be(tls_certs: TlsCerts,
                                                    tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ac.ConfigError, match="ssl_ca_certs"):
        ac.connect(f"rediss://h:1/0?ssl_ca_certs={junk}")
    with pytest.raises(ac.ConfigError, match="ssl_certfile"):
        ac.connect("rediss://h:1/0", ssl_certfile=str(junk), ssl_keyfile=tls_certs.client_key)
    with pytest.raises(ac.ConfigError, match="ssl_keyfile is given without ssl_certfile"):
        ac.connect("rediss://h:1/0", ssl_keyfile=tls_certs.client_key)
    with pytest.raises(ac.ConfigError, match=r"ssl_ca_certs=.* is not a readable file"):
        ac.connect(f"rediss://h:1/0?ssl_ca_certs={tmp_path}")  # a directory


def test_encrypted_key_is_refused_instead_of_prompting(tls_certs: TlsCerts,
                                                       tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(Path(tls_certs.client_key).read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pass")))
    with pytest.raises(ac.ConfigError, match="encrypted"):
        ac.connect("rediss://h:1/0", ssl_certfile=tls_certs.client_cert,
                   ssl_keyfile=str(encrypted))


def test_tls_options_without_tls_are_refused(tls_certs: TlsCerts) -> None:
    ca = tls_certs.server.ca_cert
    for url in (f"redis://h:1/0?ssl_ca_certs={ca}", f"memcached://h:1?ssl_ca_certs={ca}",
                "redis+cluster://h:1?ssl_check_hostname=false"):
        with pytest.raises(ac.ConfigError, match="does not use TLS"):
            ac.connect(url)
    with pytest.raises(ac.ConfigError, match="unix socket"):
        ac.connect("unix:///tmp/r.sock?tls=true")


def test_pickled_tls_client_carries_paths_not_key_contents(tls_certs: TlsCerts) -> None:
    c = ac.connect("rediss://h:1/0", ssl_ca_certs=tls_certs.server.ca_cert,
                   ssl_certfile=tls_certs.client_cert, ssl_keyfile=tls_certs.client_key)
    blob = pickle.dumps(c)
    key_body = Path(tls_certs.client_key).read_text().splitlines()[1].encode()
    assert key_body not in blob and tls_certs.client_key.encode() in blob
    assert key_body.decode() not in repr(c)
    clone = pickle.loads(blob)
    assert clone.tls == c.tls
