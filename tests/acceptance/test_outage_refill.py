"""A store back from an outage is filled again (issue 37).

A pipe reads half the indices (computed, written), the store (or one node of it) is
killed, the other half is read (computed; the writes fail and the values are kept in
this process's read-your-writes record), then the store is started again on the same
port, empty. Within the back-off the record's values are written again in the background,
values the store lost since they were acknowledged are written again when read, and a
second process reads them as hits. The counters say what each read was:
``hits + misses + recalled == reads``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import asynccache as ac
from asynccache.cache.health import BACKOFF_MAX
from asynccache.testing import servers

N = 200
HALF = N // 2
#: the bound on the refill: the longest back-off, then time for a busy box to write 200
#: values; what it guards against is "never" (the store stayed empty for ever)
REFILL_WITHIN = BACKOFF_MAX + 20.0


def value_of(index: int) -> dict[str, Any]:
    return {"index": index, "payload": bytes([index % 251]) * 500}


class Source:
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict[str, Any]:
        return value_of(index)


@dataclass
class Store:
    """A deployment: how to reach it, how to break and mend it, and its raw reads."""

    url: str  # what the pipe connects to (a Tiered pair is built by ``client``)
    kill: Callable[[], None]
    restart: Callable[[], None]
    raw_url: str  # the store that is killed, read directly
    client: Callable[[], ac.BaseClient]
    #: indices the store must hold again (Tiered: far lost the first half, which near
    #: holds and answers: nothing asks far for it, so only the record's half comes back)
    refilled: range = range(N)
    owned: list[Any] = field(default_factory=list)

    def missing(self, keys: list[bytes]) -> int:
        async def get() -> list[bytes | None]:
            client = ac.connect(self.raw_url, timeout=5)
            try:
                return await client.get_many(keys)
            finally:
                await client.close()

        return sum(blob is None for blob in asyncio.run(get()))


def _deploy(kind: str, tmp_path: Path) -> Store:
    if kind in ("redis", "memcached"):
        node = servers.start_redis() if kind == "redis" else servers.start_memcached()
        return Store(node.url, node.kill, node.restart, node.url,
                     lambda: ac.connect(node.url), owned=[node])
    if kind == "memcached-pool":
        nodes = [servers.start_memcached() for _ in range(3)]
        url = "memcached://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
        return Store(url, nodes[1].kill, nodes[1].restart, url, lambda: ac.connect(url),
                     owned=nodes)
    if kind == "cluster":
        cluster = servers.start_redis_cluster(3)
        return Store(cluster.url, lambda: cluster.kill(1), lambda: cluster.restart(1),
                     cluster.url, lambda: ac.connect(cluster.url), owned=[cluster])
    if kind == "tiered":
        far = servers.start_redis()
        near = f"lmdb://{tmp_path / 'near'}"
        return Store(near, far.kill, far.restart, far.url,
                     lambda: ac.Tiered(ac.connect(near), ac.connect(far.url)),
                     refilled=range(HALF, N), owned=[far])
    raise AssertionError(kind)


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    deployed = _deploy(request.param, tmp_path)
    try:
        yield deployed
    finally:
        for thing in deployed.owned:
            thing.stop()


SECOND_PROCESS = textwrap.dedent("""
    import json, sys
    import asynccache as ac
    sys.path.insert(0, {tests!r})
    from test_outage_refill import Source, value_of, N
    computed = []
    class Recording(Source):
        def __getitem__(self, index):
            computed.append(index)
            return value_of(index)
    client = {client}
    with ac.AsyncKVCacheMapDataPipe(Recording(), client, prefetch=16,
                                    namespace={namespace!r}) as dp:
        wrong = sum(dp[i] != value_of(i) for i in range(N))
    print(json.dumps({{"computed": computed, "wrong": wrong}}))
""")


def second_process(store: Store, kind: str, namespace: str, tmp_path: Path) -> dict[str, Any]:
    """A pipe of the same namespace in another process (another machine's near, for
    Tiered): which indices it had to compute."""
    if kind == "tiered":
        client = (f"ac.Tiered(ac.connect('lmdb://{tmp_path / 'other-near'}'), "
                  f"ac.connect({store.raw_url!r}))")
    else:
        client = f"ac.connect({store.url!r})"
    code = SECOND_PROCESS.format(tests=str(Path(__file__).parent), client=client,
                                 namespace=namespace)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def wait_for(condition: Callable[[], bool], within: float = 30.0) -> None:
    """Until ``condition()`` (write-behind fails in the background), bounded."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not within {within} s"
        time.sleep(0.05)


def read_all(dp: ac.AsyncKVCacheMapDataPipe, indices: range) -> int:
    wrong = sum(dp[i] != value_of(i) for i in indices)
    assert wrong == 0, f"{wrong} of {len(indices)} reads wrong"
    return len(indices)


KINDS = ["redis", "memcached", "memcached-pool", "cluster", "tiered"]


@pytest.mark.parametrize("store", KINDS, indirect=True)
def test_a_restarted_store_is_filled_again_and_another_process_reads_hits(
        store: Store, request: pytest.FixtureRequest, namespace: str,
        tmp_path: Path) -> None:
    kind = request.node.callspec.params["store"]
    dp = ac.AsyncKVCacheMapDataPipe(Source(), store.client(), prefetch=16,
                                    namespace=namespace)
    keys = [dp.key_for(i) for i in range(N)]
    reads = 0
    try:
        values = dp.__getitems__(list(range(HALF)))  # outside workers: waits for its writes
        reads += HALF
        assert values == [value_of(i) for i in range(HALF)]
        assert store.missing(keys[:HALF]) == 0
        store.kill()
        reads += read_all(dp, range(HALF, N))  # computed; their writes fail
        wait_for(lambda: dp.stats()["unstored_values"] > 0)
        store.restart()
        deadline = time.monotonic() + REFILL_WITHIN
        while True:  # reads again and again, as a training loop does
            reads += read_all(dp, range(N))
            left = store.missing([keys[i] for i in store.refilled])
            if left == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        stats = dp.stats()
        assert left == 0, f"{left} of {len(store.refilled)} values not in the store " \
                          f"{REFILL_WITHIN:.0f} s after the restart: {stats}"
    finally:
        dp.close()
    stats = dp.stats()
    assert stats["unstored_values"] == 0, stats
    assert stats["rewritten"] > 0, stats
    # every read counted once, as what it was
    assert stats["hits"] + stats["misses"] + stats["recalled"] == reads, stats
    assert stats["computed"] == N, stats
    other = second_process(store, kind, namespace, tmp_path)
    assert other["wrong"] == 0
    assert not set(other["computed"]) & set(store.refilled), other["computed"]


@pytest.mark.parametrize("store", ["redis"], indirect=True)
def test_without_reads_the_kept_values_reach_the_store_after_its_back_off(
        store: Store, namespace: str) -> None:
    """Nothing reads after the restart: the writer's own probe (once the back-off ends)
    finds the store back and writes what it lacks."""
    dp = ac.AsyncKVCacheMapDataPipe(Source(), store.client(), prefetch=16,
                                    namespace=namespace)
    try:
        store.kill()
        read_all(dp, range(N))
        wait_for(lambda: dp.stats()["unstored_values"] > 0)
        store.restart()
        keys = [dp.key_for(i) for i in range(N)]
        deadline = time.monotonic() + REFILL_WITHIN
        while (left := store.missing(keys)) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert left == 0, dp.stats()
        assert dp.stats()["unstored_values"] == 0
    finally:
        dp.close()


@pytest.mark.parametrize("store", ["redis"], indirect=True)
def test_reads_answered_from_the_record_are_counted_as_recalled_not_misses(
        store: Store, namespace: str) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(Source(), store.client(), prefetch=16,
                                    namespace=namespace)
    try:
        store.kill()
        reads = read_all(dp, range(N))
        for _ in range(3):  # the store is down: every read is the record's
            reads += read_all(dp, range(N))
        # the writes of the computed values fail behind the reads (CI, loaded: none had
        # failed yet when the stats were read)
        wait_for(lambda: dp.stats()["unstored_values"] > 0)
        stats = dp.stats()
    finally:
        dp.close()
    assert stats["computed"] == stats["misses"] == N, stats
    assert stats["recalled"] == 3 * N and stats["hits"] == 0, stats
    assert stats["hits"] + stats["misses"] + stats["recalled"] == reads
    assert stats["unstored_values"] > 0 and stats["kept_bytes"] > 0, stats


def test_a_closed_pipe_opens_no_connection_when_its_store_comes_back(
        redis_server: servers.RedisServer, namespace: str) -> None:
    """A pipe closed while it keeps values the store lacks (the store refused its
    connections) is done with the store: when the store comes back, neither the writer's
    probe nor anything else opens a connection for it again (such a connection was
    nobody's to close: on a cluster, redis-py's ``Unclosed RedisCluster`` warnings)."""
    from asynccache.testing.proxy import FaultProxy, url_through

    with FaultProxy(redis_server.host, redis_server.port) as proxy:
        client = ac.connect(url_through(proxy, redis_server.url), timeout=0.5,
                            connect_timeout=0.5)
        dp = ac.AsyncKVCacheMapDataPipe(Source(), client, prefetch=4, namespace=namespace)
        proxy.set_refuse(True)
        try:
            read_all(dp, range(20))
            wait_for(lambda: dp.stats()["unstored_values"] > 0)
        finally:
            dp.close(timeout=1)
        proxy.set_refuse(False)
        accepted = proxy.stats["accepted"]
        time.sleep(4 * 0.5 + 1.0)  # past the writer's probe of the first back-offs
        assert proxy.stats["accepted"] == accepted
        assert proxy.connections == 0
