"""``ac.Tiered(near, far)`` on real stores: LMDB (or a Valkey) of this machine in front of a
shared Redis (or memcached), with far killed, black-holed and full stores.

What each test checks is what docs/stores.md ("Tiers") promises: a near hit never reaches
far (far's own command counters say so), far's hits are copied into near, a full near
refuses copies without breaking anything, far down costs only what near lacks, far is
used again once it is back, and the pipe, the node, DataLoader workers, leases and the
command line (warm, stats, flush) all work on a tiered client.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, SequentialSampler
from torchdata.nodes import Loader, SamplerWrapper

import asynccache as ac
from asynccache.nodes import CachedMapper
from asynccache.testing import servers
from asynccache.testing.proxy import FaultProxy, url_through
from conftest import computed, record_computation

N = 64
SIZE = 2048
TIMEOUT = 0.25
RECOVER_WITHIN = 40.0  # the longest back-off is 30 s


class Source:
    """index -> a value naming it; each computation appended to ``log`` (any process)."""

    def __init__(self, n: int = N, log: str | None = None, size: int = SIZE,
                 compute: float = 0.0) -> None:
        self.n = n
        self.log = log
        self.size = size
        self.compute = compute

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        if self.log is not None:
            record_computation(self.log, index)
        if self.compute:
            time.sleep(self.compute)
        return {"i": index, "pad": bytes([index % 251]) * self.size}


def right(value: Any, index: int, size: int = SIZE) -> bool:
    return (isinstance(value, dict) and value.get("i") == index
            and value.get("pad") == bytes([index % 251]) * size)


def far_reads(server: servers.RedisServer) -> int:
    """Read commands far has answered (``INFO commandstats``): MGET, GET, EXISTS, STRLEN."""
    stats = server.call("INFO", "commandstats").decode()
    total = 0
    for line in stats.splitlines():
        name, _, rest = line.partition(":")
        if name in ("cmdstat_mget", "cmdstat_get", "cmdstat_exists", "cmdstat_strlen"):
            total += int(rest.split(",")[0].split("=")[1])
    return total


@pytest.fixture(scope="module")
def far_server() -> Iterator[servers.RedisServer]:
    """A Redis of this module's own: its command counters are this module's alone."""
    with servers.start_redis(prefer="redis") as server:
        yield server


@pytest.fixture
def near_url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path}/near?map_size=64MiB"


def fill_far(far_url: str, namespace: str, indices: range, size: int = SIZE) -> None:
    """Values in far only, as a pipe on another machine would have left them."""
    with ac.AsyncKVCacheMapDataPipe(Source(size=size, n=max(indices) + 1), ac.connect(far_url),
                                    namespace=namespace) as dp:
        dp.__getitems__(list(indices))


def near_keys(near_url: str, namespace: str) -> int:
    async def count() -> int:
        client = ac.connect(near_url)
        prefix = b"ac:" + namespace.encode() + b":"
        try:
            return sum([len(page) async for page in client.scan(prefix)])
        finally:
            await client.close()

    return asyncio.run(count())


# -- reads ------------------------------------------------------------------------------------
def test_near_hits_never_reach_far_and_far_hits_are_copied_into_near(
        far_server: servers.RedisServer, near_url: str, namespace: str) -> None:
    fill_far(far_server.url, namespace, range(N))
    client = ac.Tiered(ac.connect(near_url), ac.connect(far_server.url))
    with ac.AsyncKVCacheMapDataPipe(Source(), client, namespace=namespace) as dp:
        assert all(right(v, i) for i, v in enumerate(dp.__getitems__(list(range(N)))))
    first = dp.stats()
    assert first["computed"] == 0 and first["tier_far_hits"] == N
    assert first["tier_copies"] == N  # counted once the copies landed (close waits for them)
    assert near_keys(near_url, namespace) == N

    before = far_reads(far_server)
    with ac.AsyncKVCacheMapDataPipe(Source(), client, namespace=namespace) as dp:
        assert all(right(dp[i], i) for i in range(N))  # read-ahead, one batch after another
        assert all(right(v, i) for i, v in enumerate(dp.__getitems__(list(range(N)))))
    again = dp.stats()
    assert far_reads(far_server) == before  # not one read reached far
    assert again["tier_near_hits"] == again["hits"] > 0 and again.get("tier_far_hits", 0) == 0
    assert again["computed"] == 0


def test_writes_reach_both_tiers_with_their_ttl(
        far_server: servers.RedisServer, near_url: str, namespace: str) -> None:
    client = ac.Tiered(ac.connect(near_url), ac.connect(far_server.url))
    with ac.AsyncKVCacheMapDataPipe(Source(), client, namespace=namespace, ttl=1) as dp:
        assert all(right(v, i) for i, v in enumerate(dp.__getitems__(list(range(8)))))
    assert near_keys(near_url, namespace) == 8

    async def look() -> tuple[list[bytes | None], list[bytes | None]]:
        keys = [dp.key_for(i) for i in range(8)]
        near, far = ac.connect(near_url), ac.connect(far_server.url)
        try:
            return await near.get_many(keys), await far.get_many(keys)
        finally:
            await near.close()
            await far.close()

    near_values, far_values = asyncio.run(look())
    assert None not in near_values and near_values == far_values
    ttl = far_server.call("PTTL", dp.key_for(3))
    assert 0 < int(ttl) <= 1000
    time.sleep(1.2)
    assert asyncio.run(look()) == ([None] * 8, [None] * 8)  # expired in both tiers


def test_a_value_set_with_a_ttl_expires_even_when_far_outlives_near(
        memcached_server: servers.MemcachedServer, near_url: str, namespace: str) -> None:
    """memcached keeps a value whole seconds, rounded up (ttl=0.5: 1 to 2 s); LMDB to
    the instant. Read between the two expiries, the value is a far hit and is copied back
    into near: the copy must expire too (no later than the cache's ttl), not live on in
    near after far dropped it."""

    async def body() -> tuple[Any, Any]:
        client = ac.Tiered(ac.connect(near_url), ac.connect(memcached_server.url))
        async with ac.AsyncKVCache(client, namespace=namespace, ttl=0.5) as cache:
            await cache.set("k", "v")
            await asyncio.sleep(0.8)  # gone from near, still in far (at least 1 s there)
            between = await cache.get("k", "gone")
        await asyncio.sleep(3.0)  # far's expiry too, and any copy's
        async with ac.AsyncKVCache(ac.Tiered(ac.connect(near_url),
                                             ac.connect(memcached_server.url)),
                                   namespace=namespace) as cache:
            return between, await cache.get("k", "gone")

    between, later = asyncio.run(body())
    assert between == "v"  # from far
    assert later == "gone"  # a value set with a ttl never lives on in near


def test_a_copy_into_near_expires_with_the_reading_caches_ttl(
        far_server: servers.RedisServer, near_url: str, namespace: str) -> None:
    """Another machine wrote the value into far with ttl=1; this machine's cache (same
    ttl) reads it, and near keeps a copy: once far has dropped it, near must not serve
    it for ever (copy_ttl is not given)."""

    async def body() -> tuple[Any, Any]:
        async with ac.AsyncKVCache(ac.connect(far_server.url), namespace=namespace,
                                   ttl=datetime.timedelta(seconds=1)) as other_machine:
            await other_machine.set("k", "v")
        client = ac.Tiered(ac.connect(near_url), ac.connect(far_server.url))
        async with ac.AsyncKVCache(client, namespace=namespace,
                                   ttl=datetime.timedelta(seconds=1)) as cache:
            first = await cache.get("k", "gone")  # a far hit, copied into near
        await asyncio.sleep(2.0)
        async with ac.AsyncKVCache(client, namespace=namespace, ttl=1) as cache:
            return first, await cache.get("k", "gone")

    first, later = asyncio.run(body())
    assert first == "v"
    assert later == "gone"


@pytest.mark.parametrize("near_kind", ["lmdb", "valkey-noeviction"])
def test_a_full_near_refuses_copies_and_writes_and_nothing_breaks(
        near_kind: str, far_server: servers.RedisServer, tmp_path: Path,
        namespace: str) -> None:
    size = 8192  # 64 values: 512 KiB, far over either near's room
    with _full_near(near_kind, tmp_path) as near_url:
        fill_far(far_server.url, namespace, range(N), size)
        client = ac.Tiered(ac.connect(near_url), ac.connect(far_server.url))
        with ac.AsyncKVCacheMapDataPipe(Source(size=size), client, namespace=namespace) as dp:
            for start in range(0, N, 8):  # several batches: copies refused, then paused
                got = dp.__getitems__(list(range(start, start + 8)))
                assert all(right(v, start + i, size) for i, v in enumerate(got))
        stats = dp.stats()
        assert stats["computed"] == 0 and stats["errors"] == 0
        assert stats["tier_near_refused"] > 0
        assert stats.get("tier_copies", 0) < N

        # writes too: computed values go to far whatever near says, and are read back
        log = tmp_path / "log"
        with ac.AsyncKVCacheMapDataPipe(Source(size=size, log=str(log)), client,
                                        namespace=namespace + "-w") as dp:
            got = dp.__getitems__(list(range(N)))
            assert all(right(v, i, size) for i, v in enumerate(got))
        with ac.AsyncKVCacheMapDataPipe(Source(size=size, log=str(log)),
                                        ac.connect(far_server.url),
                                        namespace=namespace + "-w") as far_only:
            assert all(right(far_only[i], i, size) for i in range(N))
        assert sorted(computed(log)) == list(range(N))  # each computed once, all in far


@contextlib.contextmanager
def _full_near(kind: str, tmp_path: Path) -> Iterator[str]:
    """A near store with room for a few values only: LMDB at its smallest map, or a
    Valkey with ``maxmemory`` just above what it uses empty and ``noeviction`` (it
    answers writes with OOM)."""
    if kind == "lmdb":
        yield f"lmdb://{tmp_path}/tiny?map_size=64KiB"
        return
    with servers.start_redis(prefer="embedded", maxmemory="3mb",
                             maxmemory_policy="noeviction") as server:
        info = server.call("INFO", "memory").decode()
        used = int(dict(line.split(":", 1) for line in info.splitlines()
                        if ":" in line)["used_memory"])
        server.call("CONFIG", "SET", "maxmemory", str(used + 64 * 1024))
        yield server.url


@pytest.mark.parametrize("near_kind", ["lmdb", "valkey-noeviction"])
def test_a_value_a_full_near_refuses_replaces_the_one_near_held(
        near_kind: str, far_server: servers.RedisServer, tmp_path: Path,
        namespace: str) -> None:
    """Read your writes with a full near: ``set(k, new)`` is taken by far and refused by
    near, which held an older value under ``k``; ``get(k)`` must be ``new``, not the
    older value near still had."""
    with _full_near(near_kind, tmp_path) as near_url:
        client = ac.Tiered(ac.connect(near_url), ac.connect(far_server.url))

        async def body() -> Any:
            async with ac.AsyncKVCache(client, namespace=namespace) as cache:
                await cache.set("k", "old")
                new = "new" * 100_000  # 300 KB: over either near's room
                await cache.set("k", new)
                return new, await cache.get("k")

        new, got = asyncio.run(body())
        assert got == new


# -- far in trouble ----------------------------------------------------------------------------
def test_far_killed_near_serves_what_it_holds_and_far_is_used_again_when_back(
        near_url: str, namespace: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    with servers.start_redis(prefer="redis") as far_server:
        far_url = far_server.url
        client = ac.Tiered(ac.connect(near_url),
                           ac.connect(far_url, timeout=TIMEOUT, connect_timeout=TIMEOUT))
        with ac.AsyncKVCacheMapDataPipe(Source(n=4 * N, log=str(log)), client,
                                        namespace=namespace) as dp:
            dp.__getitems__(list(range(N // 2)))  # both tiers hold the first half
        far_server.kill()

        dp = ac.AsyncKVCacheMapDataPipe(Source(n=4 * N, log=str(log)), client,
                                        namespace=namespace)
        try:
            for i in range(N):  # training goes on: every value right, no exception
                started = time.monotonic()
                assert right(dp[i], i)
                assert time.monotonic() - started < 10 * TIMEOUT + 1
            down = dp.stats()
            assert sorted(computed(log)) == list(range(N))  # only what near lacked
            assert down["errors"] + down["skipped"] > 0
            assert down["tier_near_hits"] >= N // 2

            far_server.restart()  # empty: values another machine writes now come from far
            fill_far(far_url, namespace, range(N, 4 * N))
            deadline = time.monotonic() + RECOVER_WITHIN
            i = N
            while dp.stats().get("tier_far_hits", 0) == 0:
                assert time.monotonic() < deadline, "far was not used again after its back-off"
                assert right(dp[i], i)
                i += 1
                time.sleep(0.2)
            assert right(dp[i], i)
        finally:
            dp.close()


def test_far_black_holed_costs_a_timeout_then_near_alone(
        far_server: servers.RedisServer, near_url: str, namespace: str, tmp_path: Path
        ) -> None:
    log = tmp_path / "log"
    assert far_server.port is not None
    with FaultProxy(far_server.host, far_server.port).start() as proxy:
        far_url = url_through(proxy, far_server.url)
        client = ac.Tiered(ac.connect(near_url),
                           ac.connect(far_url, timeout=TIMEOUT, connect_timeout=TIMEOUT))
        with ac.AsyncKVCacheMapDataPipe(Source(log=str(log)), client, namespace=namespace) as dp:
            dp.__getitems__(list(range(N // 2)))
            proxy.set_blackhole(True)
            slowest = 0.0
            for start in range(0, N, 8):
                began = time.monotonic()
                got = dp.__getitems__(list(range(start, start + 8)))
                slowest = max(slowest, time.monotonic() - began)
                assert all(right(v, start + i) for i, v in enumerate(got))
            proxy.set_blackhole(False)
        stats = dp.stats()
        assert slowest < 10 * TIMEOUT + 1  # bounded by far's timeout, not hung
        assert stats["timeouts"] >= 1
        assert sorted(computed(log)) == list(range(N))  # the first half came from near


def test_near_killed_far_serves_everything(
        far_server: servers.RedisServer, namespace: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    with servers.start_redis(prefer="embedded") as near_server:
        client = ac.Tiered(ac.connect(near_server.url, timeout=TIMEOUT,
                                      connect_timeout=TIMEOUT), ac.connect(far_server.url))
        with ac.AsyncKVCacheMapDataPipe(Source(log=str(log)), client,
                                        namespace=namespace) as dp:
            dp.__getitems__(list(range(N)))
        near_server.kill()
        with ac.AsyncKVCacheMapDataPipe(Source(log=str(log)), client,
                                        namespace=namespace) as dp:
            assert all(right(dp[i], i) for i in range(N))
            assert all(right(v, i) for i, v in enumerate(dp.__getitems__(list(range(N)))))
        stats = dp.stats()
    assert sorted(computed(log)) == list(range(N))  # nothing computed again: far had it all
    assert stats["errors"] >= 1 and stats["tier_far_hits"] >= N
    assert stats.get("tier_copies", 0) == 0  # never copied into a node that is down


# -- the pipe in DataLoader workers, the node, leases ---------------------------------------------
def _listed(batch: list[Any]) -> list[Any]:
    return batch


def test_dataloader_fork_workers_read_both_tiers_right(
        far_server: servers.RedisServer, near_url: str, namespace: str, tmp_path: Path
        ) -> None:
    log = tmp_path / "log"
    client = ac.Tiered(ac.connect(near_url), ac.connect(far_server.url))
    dp = ac.AsyncKVCacheMapDataPipe(Source(log=str(log)), client, namespace=namespace)
    loader = DataLoader(dp, batch_size=8, num_workers=2, collate_fn=_listed,
                        multiprocessing_context="fork")
    try:
        for _epoch in range(2):
            values = [v for batch in loader for v in batch]
            assert sorted(v["i"] for v in values) == list(range(N))
            assert all(right(v, v["i"]) for v in values)
        stats = dp.stats()
    finally:
        dp.close()
    assert sorted(computed(log)) == list(range(N))  # epoch 1 only
    assert stats["tier_near_hits"] >= N  # epoch 2 from near, in the workers


def test_the_node_reads_a_tiered_client(
        far_server: servers.RedisServer, near_url: str, namespace: str, tmp_path: Path
        ) -> None:
    log = tmp_path / "log"
    ds = Source(log=str(log))
    client = ac.Tiered(ac.connect(near_url), ac.connect(far_server.url))
    for _epoch in range(2):
        node = CachedMapper(SamplerWrapper(SequentialSampler(range(N))), ds.__getitem__,
                            client, namespace=namespace, prefetch=16)
        got = list(Loader(node))
        stats = node.stats()
        node.close()
        assert [v["i"] for v in got] == list(range(N)) and all(right(v, v["i"]) for v in got)
    assert sorted(computed(log)) == list(range(N))
    assert stats["tier_near_hits"] == N


def _machine(near_url: str, far_url: str, namespace: str, log: str, barrier: Any,
             results: Any) -> None:
    """One machine: its own near, the shared far, leases."""
    dp = ac.AsyncKVCacheMapDataPipe(Source(log=log, compute=0.01), ac.Tiered(ac.connect(near_url),
                                                               ac.connect(far_url)),
                                    namespace=namespace, lease=10)
    barrier.wait()
    ok = True
    for start in range(0, N, 8):
        got = dp.__getitems__(list(range(start, start + 8)))
        ok &= all(right(v, start + i) for i, v in enumerate(got))
    stats = dp.stats()
    dp.close()
    results.put((ok, stats))


def test_leases_are_shared_through_far_by_machines_with_their_own_near(
        far_server: servers.RedisServer, namespace: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_machine, args=(f"lmdb://{tmp_path}/near{m}", far_server.url,
                                                namespace, str(log), barrier, results))
             for m in range(2)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
    assert all(ok for ok, _ in outcomes)
    assert all(stats["errors"] == 0 for _, stats in outcomes)
    done = computed(log)
    assert sorted(set(done)) == list(range(N))
    assert len(done) <= N + 2  # each key computed about once across both machines


# -- the command line -----------------------------------------------------------------------------
DATASET = f'''
class Items:
    def __len__(self):
        return {N}

    def __getitem__(self, index):
        return {{"i": index, "pad": bytes([index % 251]) * {SIZE}}}
'''


def run_cli(*args: str, cwd: Path) -> dict[str, Any]:
    environ = dict(os.environ)
    src = str(Path(ac.__file__).parent.parent)
    environ["PYTHONPATH"] = os.pathsep.join([src, str(cwd), environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "asynccache", *args, "--json"],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=environ,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_warm_stats_and_flush_work_on_both_tiers(
        far_server: servers.RedisServer, near_url: str, namespace: str, tmp_path: Path
        ) -> None:
    (tmp_path / "tiered_items.py").write_text(DATASET)
    far_url = far_server.url
    warmed = run_cli("warm", far_url, "--near", near_url, "--dataset", "tiered_items:Items",
                     "--namespace", namespace, "--workers", "2", cwd=tmp_path)
    assert (warmed["computed"], warmed["failed"]) == (N, 0)

    stats = run_cli("stats", far_url, "--near", near_url, "--namespace", namespace,
                    cwd=tmp_path)
    assert stats["values"] == N and stats["near"]["values"] == N
    assert stats["near"]["url"].startswith("lmdb://")

    before = far_reads(far_server)
    with ac.AsyncKVCacheMapDataPipe(Source(), ac.Tiered(ac.connect(near_url),
                                                        ac.connect(far_url)),
                                    namespace=namespace) as dp:
        assert all(right(v, i) for i, v in enumerate(dp.__getitems__(list(range(N)))))
    assert dp.stats()["computed"] == 0 and far_reads(far_server) == before  # all from near

    again = run_cli("warm", far_url, "--near", near_url, "--dataset", "tiered_items:Items",
                    "--namespace", namespace, cwd=tmp_path)
    assert (again["computed"], again["skipped"]) == (0, N)  # resumable on a tiered client

    flushed = run_cli("flush", far_url, "--near", near_url, "--namespace", namespace, "--yes",
                      cwd=tmp_path)
    assert flushed["tiers"]["far"]["deleted"] == N and flushed["tiers"]["near"]["deleted"] == N
    assert flushed["deleted"] == 2 * N
    after = run_cli("stats", far_url, "--near", near_url, "--namespace", namespace,
                    cwd=tmp_path)
    assert after["keys"] == 0 and after["near"]["keys"] == 0


def test_flush_with_near_a_no_to_either_prompt_deletes_nothing(
        far_server: servers.RedisServer, near_url: str, namespace: str) -> None:
    """Two prompts (far's, then near's): "nothing deleted" (exit 1) must be true, so a
    "no" to near's prompt must not come after far was already flushed."""
    fill_far(far_server.url, namespace, range(8))
    client = ac.Tiered(ac.connect(near_url), ac.connect(far_server.url))
    with ac.AsyncKVCacheMapDataPipe(Source(), client, namespace=namespace) as dp:
        dp.__getitems__(list(range(8)))  # near holds copies of them
    assert near_keys(near_url, namespace) == 8

    environ = {**os.environ, "PYTHONPATH": str(Path(ac.__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-m", "asynccache", "flush", far_server.url,
                           "--near", near_url, "--namespace", namespace],
                          input="y\nn\n", capture_output=True, text=True, timeout=120,
                          env=environ, check=False)
    assert done.returncode == 1 and "nothing deleted" in done.stderr, done.stderr
    assert near_keys(near_url, namespace) == 8
    assert near_keys(far_server.url, namespace) == 8  # far's keys are still there


# -- the benchmark module -------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_the_tiered_bench_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``asynccache bench --only tiered`` end to end in its smoke size: the shape of its
    results only, never a timing."""
    from asynccache.__main__ import main

    code = main(["bench", "--smoke", "--only", "tiered", "--servers", "redis", "--no-progress",
                 "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    doc = json.loads((tmp_path / "results.json").read_text())
    entry = doc["modules"]["tiered"]
    assert "error" not in entry, entry.get("error")
    (level,) = entry["results"]["levels"]
    assert level["rtt_added_s"] == 1e-3 and level["ping_us"] > 0
    assert set(level["cases"]) == {"far alone", "tiered, warm from near", "tiered, near empty",
                                   "near alone"}
    assert all(case["epoch_s"] > 0 for case in level["cases"].values())
    config = entry["results"]["config"]
    # copied in DataLoader workers, reported as of their last report (on a busy machine a
    # report may not have arrived: 0 is possible, a figure, not a defect); each worker
    # reads ahead its next epoch's first batch as its share ends (these workers are not
    # persistent: a batch each, wasted, maybe copied once more). Since every batch is
    # reported (issue 38) the counts are whole, and two workers reading ahead the same
    # first batches of an epoch may each copy them (199 of 128 items seen in one CI run):
    # the bound is the scale of the defect (copies without end), not an exact figure
    most = 2 * (config["items"] + config["workers"] * config["batch"])
    assert level["copied_per_empty_epoch"] and all(
        0 <= copied <= most for copied in level["copied_per_empty_epoch"])
    assert entry["plots"] and "Near/far tier" in (tmp_path / "summary.md").read_text()
