"""Servers die with the process that started them, SIGKILL included, and leave no temp
dir: ``asynccache.testing``'s (tests, benchmarks), ``asynccache serve``'s and the demo's.

Each test starts a parent process that starts a server, kills the parent with SIGKILL
(nothing of it runs afterwards: no finalizer, no atexit) and waits, generously, for the
server to be gone and its ``/tmp/asynccache-*`` directory removed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import asynccache as ac

GONE_WITHIN = 15.0  # seconds: the watchdog needs well under one; a busy box, more

PARENT = """
import json, sys, time
from asynccache.testing import servers
kind = sys.argv[1]
if kind == "cluster":
    started = servers.start_redis_cluster(3).nodes
elif kind == "memcached":
    started = [servers.start_memcached()]
else:
    started = [servers.start_redis(prefer=kind, unix_socket=kind == "redis")]
print(json.dumps([[s.pid, s.temp_dir] for s in started]), flush=True)
time.sleep(600)
"""


def environ() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(ac.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    return env


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is dead: it holds no port, runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_until(condition: object, timeout: float = GONE_WITHIN) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return bool(condition())  # type: ignore[operator]


def children_of(pid: int) -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == pid:
            found.append((int(entry), comm))
    return found


class Reaper:
    """Parents started by a test, and pids to SIGKILL after it, whatever happened (never
    leave a server behind)."""

    def __init__(self) -> None:
        self.parents: list[subprocess.Popen[str]] = []
        self.pids: list[int] = []

    def start(self, argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
        parent = subprocess.Popen(argv, text=True, env=environ(), **kwargs)  # type: ignore[call-overload]
        self.parents.append(parent)
        return parent

    def append(self, pid: int) -> None:
        self.pids.append(pid)

    def extend(self, pids: object) -> None:
        self.pids.extend(pids)  # type: ignore[arg-type]

    def finish(self) -> None:
        for parent in self.parents:
            if parent.poll() is None:
                parent.kill()
            parent.wait()
            if parent.stdout is not None:
                parent.stdout.close()
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def reap() -> Iterator[Reaper]:
    reaper = Reaper()
    yield reaper
    reaper.finish()


def assert_gone_after_parent_killed(parent: subprocess.Popen[str],
                                    started: list[tuple[int, str]]) -> None:
    for pid, temp_dir in started:
        assert alive(pid) and os.path.isdir(temp_dir)
        assert os.path.basename(temp_dir).startswith("asynccache-")
    parent.kill()  # SIGKILL: the parent runs nothing more
    parent.wait()
    for pid, temp_dir in started:
        assert wait_until(lambda pid=pid: not alive(pid)), f"server {pid} outlived its parent"
        assert wait_until(lambda d=temp_dir: not os.path.exists(d)), f"{temp_dir} was left"


@pytest.mark.parametrize("kind", ["redis", "valkey", "memcached", "cluster"])
def test_testing_servers_die_with_their_parent(kind: str, reap: Reaper) -> None:
    parent = reap.start([sys.executable, "-c", PARENT, kind], stdout=subprocess.PIPE)
    line = parent.stdout.readline() if parent.stdout else ""
    assert line, "the parent did not start its servers"
    started = [(int(pid), str(d)) for pid, d in json.loads(line)]
    reap.extend(pid for pid, _ in started)
    assert_gone_after_parent_killed(parent, started)


@pytest.mark.parametrize("kind", ["redis", "memcached"])
def test_asynccache_serve_killed_takes_its_server_along(kind: str, reap: Reaper) -> None:
    parent = reap.start([sys.executable, "-m", "asynccache", "serve", kind, "--json"],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = parent.stdout.readline() if parent.stdout else ""
    assert line, "asynccache serve printed nothing"
    pid = json.loads(line)["pid"]
    reap.append(pid)
    temp_dir = os.readlink(f"/proc/{pid}/cwd")  # servers run in their temp dir
    assert_gone_after_parent_killed(parent, [(pid, temp_dir)])


def test_the_demo_killed_takes_its_server_along(reap: Reaper) -> None:
    """Its DataLoader workers (forked after the server started) do not keep it running."""
    parent = reap.start([sys.executable, "-m", "asynccache", "demo", "--items", "200000",
                         "--workers", "2"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    found: list[tuple[int, str]] = []

    def server_started() -> bool:
        """A running server: its cwd is the temp dir it serves from (a short-lived
        ``redis-server --version`` probe, also a child, is not)."""
        found.clear()
        for pid, comm in children_of(parent.pid):
            if comm not in ("redis-server", "valkey-server"):
                continue
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:  # gone already: the version probe
                continue
            if os.path.basename(cwd).startswith("asynccache-"):
                found.append((pid, cwd))
        return bool(found)

    assert wait_until(server_started, 120), "the demo started no server"
    ((pid, temp_dir),) = found
    reap.append(pid)
    assert wait_until(lambda: len(children_of(parent.pid)) > 2, 120)  # workers forked too
    reap.extend(child for child, _ in children_of(parent.pid))
    assert_gone_after_parent_killed(parent, [(pid, temp_dir)])
