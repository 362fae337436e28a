"""``asynccache warm`` resumes without downloading: the check for keys already there
transfers no values (Redis ``STRLEN``, memcached ``mg key s``), measured by what the
server itself says it sent (Redis ``INFO stats`` ``total_net_output_bytes``, memcached
``stats`` ``bytes_written``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import asynccache as ac
from asynccache.testing import servers

N = 1024
SIZE = 16 * 1024

DATASET = f'''
import random


class Blobs:
    def __len__(self):
        return {N}

    def __getitem__(self, index):
        return random.Random(index).randbytes({SIZE})
'''


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("warm-resume")
    (root / "warm_blobs.py").write_text(DATASET)
    return root


@pytest.fixture(scope="module")
def own_redis() -> Iterator[servers.RedisServer]:
    with servers.start_redis(prefer="redis", maxmemory="256mb") as server:
        yield server


@pytest.fixture(scope="module")
def own_memcached() -> Iterator[servers.MemcachedServer]:
    with servers.start_memcached(memory_mb=256) as server:
        yield server


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[servers.RedisCluster]:
    with servers.start_redis_cluster(3) as cluster:
        yield cluster


def warm(url: str, namespace: str, cwd: Path, *extra: str) -> dict[str, int]:
    environ = dict(os.environ)
    src = str(Path(ac.__file__).parent.parent)
    environ["PYTHONPATH"] = os.pathsep.join([src, environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "asynccache", "warm", url, "--dataset",
                           "warm_blobs:Blobs", "--namespace", namespace, "--json", *extra],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=environ,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def redis_sent(node: servers.RedisServer) -> int:
    info = node.call("INFO", "stats").decode()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    return int(fields["total_net_output_bytes"])


def memcached_sent(server: servers.MemcachedServer) -> int:
    assert server.port is not None
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"stats\r\n")
        reply = b""
        while not reply.endswith(b"END\r\n"):
            chunk = sock.recv(65536)
            assert chunk
            reply += chunk
    for line in reply.decode().splitlines():
        parts = line.split()
        if parts[:2] == ["STAT", "bytes_written"]:
            return int(parts[2])
    raise AssertionError(reply)


def resume_costs(url: str, sent: Callable[[], int], namespace: str, cwd: Path,
                 *extra: str) -> int:
    """Fill, then resume: the bytes the server(s) sent during the resume."""
    first = warm(url, namespace, cwd)
    assert (first["computed"], first["failed"]) == (N, 0)
    before = sent()
    again = warm(url, namespace, cwd, *extra)
    after = sent()
    assert (again["computed"], again["skipped"], again["failed"]) == (0, N, 0)
    return after - before


def report(store: str, nbytes: int) -> None:
    print(f"\n{store}: resume of {N} present keys of {SIZE} B sent {nbytes:,} bytes "
          f"({nbytes / N:.1f} B per key; the values are {N * SIZE:,} B)")


#: what a resume may cost: a few dozen bytes per key (sizes, PING, INFO replies), far below
#: the values (16 KiB each), which a check that read them would send
BOUND = N * 64 + 64 * 1024


def test_a_redis_resume_downloads_no_values(own_redis: servers.RedisServer,
                                            dataset_dir: Path) -> None:
    nbytes = resume_costs(own_redis.url, lambda: redis_sent(own_redis), "resume-redis",
                          dataset_dir)
    report("redis", nbytes)
    assert nbytes < BOUND


def test_a_memcached_resume_downloads_no_values(own_memcached: servers.MemcachedServer,
                                                dataset_dir: Path) -> None:
    nbytes = resume_costs(own_memcached.url, lambda: memcached_sent(own_memcached),
                          "resume-memcached", dataset_dir)
    report("memcached", nbytes)
    assert nbytes < BOUND


def test_a_cluster_resume_downloads_no_values(own_cluster: servers.RedisCluster,
                                              dataset_dir: Path) -> None:
    nbytes = resume_costs(own_cluster.url,
                          lambda: sum(redis_sent(node) for node in own_cluster.nodes),
                          "resume-cluster", dataset_dir)
    report("redis cluster", nbytes)
    assert nbytes < BOUND + 3 * 64 * 1024  # each node's slot map replies on top


def test_verify_reads_the_values_on_purpose(own_redis: servers.RedisServer,
                                            dataset_dir: Path) -> None:
    nbytes = resume_costs(own_redis.url, lambda: redis_sent(own_redis), "resume-verify",
                          dataset_dir, "--verify")
    report("redis --verify", nbytes)
    assert nbytes > N * SIZE  # the check the default avoids: it would show here
