"""Metrics and logs: the Prometheus collector, latency histograms, the summary line, the
logger's defaults and failures logged once per job (DataLoader workers included)."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch.utils.data import DataLoader

import asynccache as ac
from asynccache.metrics import CacheCollector, log_summary, register, summary_line
from asynccache.observe.board import StatsBoard
from asynccache.testing import servers
from asynccache.testing.proxy import FaultProxy, url_through

N = 128
BATCH = 16


Samples = dict[str, dict[tuple[Any, ...], float]]


def scrape(registry: CollectorRegistry) -> Samples:
    """``{sample name: {sorted label items: value}}`` from the text exposition."""
    text = generate_latest(registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    matching = [v for key, v in samples.get(name, {}).items()
                if all((k, want) in key for k, want in labels.items())]
    assert len(matching) == 1, (name, labels, samples.get(name))
    return matching[0]


def buckets(samples: Samples, kind: str) -> list[tuple[float, float]]:
    rows = [(float(dict(key)["le"]), v) for key, v in
            samples["asynccache_request_duration_seconds_bucket"].items()
            if dict(key)["kind"] == kind]
    return sorted(rows)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


# -- the collector on an AsyncKVCache ------------------------------------------------------
def test_collector_equals_stats_after_real_traffic(redis_server: Any, namespace: str,
                                                    registry: CollectorRegistry) -> None:
    async def traffic(cache: ac.AsyncKVCache) -> None:
        await cache.set_many({i: bytes(100) for i in range(50)})
        await cache.set_many({"x": 1})
        for start in range(0, 80, 20):  # 4 multi-gets: 50 hits, 30 misses
            await cache.get_many(range(start, start + 20))
        await cache.client.close()

    client = ac.connect(redis_server.url)
    cache = ac.AsyncKVCache(client, namespace=namespace)
    CacheCollector(cache, registry=registry)
    asyncio.run(traffic(cache))
    stats = cache.stats()
    got = scrape(registry)
    labels = {"namespace": namespace, "store": client.safe_url}
    assert value(got, "asynccache_hits_total", **labels) == stats["hits"] == 50
    assert value(got, "asynccache_misses_total", **labels) == stats["misses"] == 30
    assert value(got, "asynccache_sets_total", **labels) == stats["sets"] == 51
    assert value(got, "asynccache_read_bytes_total", **labels) == stats["bytes_read"] > 0
    assert value(got, "asynccache_written_bytes_total", **labels) == stats["bytes_written"] > 0
    # one observation per request: 4 multi-gets, 2 write requests
    assert value(got, "asynccache_request_duration_seconds_count", kind="read") == 4
    assert value(got, "asynccache_request_duration_seconds_count", kind="write") == 2
    assert stats["batches"] == 4 and stats["set_batches"] == 2
    for kind in ("read", "write"):
        rows = buckets(got, kind)
        counts = [n for _le, n in rows]
        assert counts == sorted(counts)  # cumulative buckets never go down
        assert rows[-1] == (float("inf"), cache.latency()[kind].count)
        assert value(got, "asynccache_request_duration_seconds_sum", kind=kind) == \
            pytest.approx(cache.latency()[kind].sum)
    assert 0 < cache.latency()["read"].sum < 5


def test_collector_shows_a_tiered_clients_counters(redis_server: Any, namespace: str,
                                                  registry: CollectorRegistry) -> None:
    async def traffic(cache: ac.AsyncKVCache) -> None:
        far_only = ac.AsyncKVCache(ac.connect(redis_server.url), namespace=namespace)
        await far_only.set_many({i: i for i in range(20)})  # in far, not in near
        await far_only.aclose()
        await cache.get_many(range(20))  # near misses, far hits: copied into near
        await cache.flush()
        await asyncio.sleep(0.2)  # the copies land after the read returned
        await cache.get_many(range(20))  # near hits
        await cache.client.close()

    client = ac.Tiered(ac.connect(f"memory://tier-{namespace}"), ac.connect(redis_server.url))
    cache = ac.AsyncKVCache(client, namespace=namespace)
    CacheCollector(cache, registry=registry)
    asyncio.run(traffic(cache))
    stats = cache.stats()
    got = scrape(registry)
    labels = {"namespace": namespace, "store": client.safe_url}
    assert stats["tier_far_hits"] == 20 and stats["tier_near_hits"] >= 1
    for name in ("tier_near_hits", "tier_far_hits", "tier_copies", "tier_near_refused",
                 "tier_near_dropped", "tier_copy_failed"):
        assert value(got, f"asynccache_{name}_total", **labels) == stats.get(name, 0)


def test_errors_by_kind_equal_stats(redis_server: Any, namespace: str,
                                    registry: CollectorRegistry) -> None:
    """Timeouts (black hole), unavailable (killed server), decode errors (garbage under a
    key), bad signatures (an unsigned value read by a signing codec): each its own label,
    together ``stats()["errors"]``."""

    async def run() -> tuple[ac.AsyncKVCache, ac.AsyncKVCache, ac.AsyncKVCache]:
        good = ac.AsyncKVCache(ac.connect(redis_server.url), namespace=namespace)
        await good.set_many({"plain": 1})
        await good.client.set(good.key("garbage"), b"not an asynccache value")
        signed = ac.AsyncKVCache(ac.connect(redis_server.url), namespace=namespace,
                                 codec=ac.Codec(secret=b"k" * 32))
        await good.get_many(["garbage"])       # decode_errors
        await signed.get_many(["plain"])       # bad_signatures
        with servers.start_redis() as doomed, FaultProxy(doomed.host, doomed.port) as proxy:
            far = ac.AsyncKVCache(ac.connect(url_through(proxy, doomed.url), timeout=0.3),
                                  namespace=namespace)
            await far.set_many({"a": 1})
            proxy.set_blackhole(True)
            assert await far.get_many(["a"]) == {}    # timeouts
            proxy.set_blackhole(False)
            doomed.kill()
            proxy.reset_all()
            await asyncio.sleep(0.6)                  # past the first back-off
            assert await far.get_many(["a"]) == {}    # unavailable
            await far.client.close()
        await good.client.close()
        await signed.client.close()
        return good, signed, far

    good, signed, far = asyncio.run(run())
    CacheCollector(good, signed, far, registry=registry)
    got = scrape(registry)
    total = {k: good.stats()[k] + signed.stats()[k] for k in good.stats()}
    assert total["decode_errors"] == 1 and total["bad_signatures"] == 1
    far_stats = far.stats()
    assert far_stats["timeouts"] >= 1 and far_stats["unavailable"] >= 1
    for kind in ("timeouts", "unavailable", "rejected", "decode_errors", "bad_signatures"):
        assert value(got, "asynccache_errors_total", kind=kind, store=good.client.safe_url) \
            == total[kind]
        assert value(got, "asynccache_errors_total", kind=kind, store=far.client.safe_url) \
            == far_stats[kind]
    for store, stats in ((good.client.safe_url, total), (far.client.safe_url, far_stats)):
        by_kind = [v for key, v in got["asynccache_errors_total"].items()
                   if ("store", store) in key]
        assert sum(by_kind) == stats["errors"] > 0  # the kinds (and "other") add up
    # the timed-out request was timed: at least its 0.3 s
    assert far.latency()["read"].sum >= 0.25


def test_collector_holds_objects_weakly(redis_server: Any, namespace: str,
                                        registry: CollectorRegistry) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(list(range(10)), ac.connect(redis_server.url),
                                    namespace=namespace)
    assert dp[3] == 3
    CacheCollector(dp, registry=registry)
    assert value(scrape(registry), "asynccache_misses_total", namespace=namespace) == 1
    dp.close()
    ref = weakref.ref(dp)
    del dp
    gc.collect()
    assert ref() is None  # the collector did not keep it alive
    assert "asynccache_misses_total" not in scrape(registry)


def test_collector_refuses_what_it_cannot_read(registry: CollectorRegistry) -> None:
    with pytest.raises(ac.ConfigError, match="CacheCollector takes"):
        CacheCollector(object(), registry=registry)


def test_missing_prometheus_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(ac.MissingDependency, match=r"asynccache\[metrics\]"):
        CacheCollector()


def test_collector_reads_a_cached_mapper(redis_server: Any, namespace: str,
                                         registry: CollectorRegistry) -> None:
    from torchdata.nodes import IterableWrapper, Loader

    from asynccache.nodes import CachedMapper

    names = [f"item-{i}" for i in range(40)]
    for _ in range(2):  # misses, then hits
        node = CachedMapper(IterableWrapper(names), str.upper, ac.connect(redis_server.url),
                            namespace=namespace, prefetch=8)
        register(node, registry=registry)  # the second call reuses the first's collector
        assert list(Loader(node)) == [n.upper() for n in names]
        node.flush()
    stats, latency = node.stats(), node.latency()
    got = scrape(registry)
    store = node.client.safe_url
    # both nodes have the same labels: the collector sums them
    assert value(got, "asynccache_hits_total", store=store) >= stats["hits"] == len(names)
    assert latency["read"].count > 0
    assert value(got, "asynccache_request_duration_seconds_count", kind="read") \
        >= latency["read"].count
    node.close()


# -- a pipe in a DataLoader with 2 workers ----------------------------------------------------
class Source(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"i": index, "x": torch.full((4,), float(index))}


def listed(batch: list[Any]) -> list[Any]:
    return batch


def test_collector_includes_dataloader_workers(redis_server: Any, namespace: str,
                                               registry: CollectorRegistry) -> None:
    with ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect(redis_server.url),
                                    namespace=namespace) as warm:
        warm.__getitems__(list(range(N)))
    dp = ac.AsyncKVCacheMapDataPipe(Source(N), ac.connect(redis_server.url),
                                    namespace=namespace)
    CacheCollector(dp, registry=registry)
    loader = DataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=2,
                        collate_fn=listed, multiprocessing_context="fork")
    assert sorted(v["i"] for batch in loader for v in batch) == list(range(N))
    deadline = time.monotonic() + 5
    while dp.stats()["hits"] < N and time.monotonic() < deadline:
        time.sleep(0.1)  # the workers' final reports
    stats = dp.stats()
    got = scrape(registry)
    assert value(got, "asynccache_hits_total", namespace=namespace) == stats["hits"] == N
    per = dp.latency(per_process=True)
    assert per[os.getpid()]["read"].count == 0  # this process read nothing ...
    workers = [lat["read"].count for pid, lat in per.items() if pid != os.getpid()]
    assert len(workers) == 2 and all(workers)  # ... the two workers did
    assert value(got, "asynccache_request_duration_seconds_count", kind="read") \
        == sum(workers) == dp.latency()["read"].count
    dp.close()


# -- the summary line ------------------------------------------------------------------------
def test_summary_line_is_logged_with_the_numbers(redis_server: Any, namespace: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(list(range(100)), ac.connect(redis_server.url),
                                    namespace=namespace)
    try:
        assert dp.__getitems__(list(range(100))) == list(range(100))  # 100 misses
        assert dp.__getitems__(list(range(40))) == list(range(40))     # 40 hits
        with caplog.at_level(logging.INFO, logger="asynccache.summary"):
            summary = log_summary(dp, every=0.05)
            deadline = time.monotonic() + 5
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.02)
            summary.stop()
            assert not summary.running
        line = caplog.records[0]
        assert line.levelno == logging.INFO and line.name == "asynccache.summary"
        text = line.getMessage()
        assert text.startswith(f"asynccache ns={namespace} hit 28.6% (40/140) errors 0 ")
        assert "p50 " in text and " ms" in text and "p99 " in text
        assert text == summary_line(dp)
        count = len(caplog.records)
        time.sleep(0.2)
        assert len(caplog.records) == count  # stopped means stopped
    finally:
        dp.close()


def test_summary_does_not_run_in_a_forked_child(redis_server: Any, namespace: str) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(list(range(10)), ac.connect(redis_server.url),
                                    namespace=namespace)
    summary = log_summary(dp, every=30)
    try:
        ctx = multiprocessing.get_context("fork")
        child = ctx.Process(target=_child_checks, args=(summary,))
        child.start()
        child.join(10)
        assert child.exitcode == 0
        assert summary.running  # the parent's keeps going
    finally:
        summary.stop()
        dp.close()


def _child_checks(summary: Any) -> None:
    started = time.monotonic()
    summary.stop()  # a no-op there: returns at once, joins nothing
    os._exit(0 if not summary.running and time.monotonic() - started < 1 else 1)


def test_summary_refuses_bad_arguments(redis_server: Any) -> None:
    with pytest.raises(ac.ConfigError, match="every"):
        log_summary(ac.AsyncKVCache(ac.connect(redis_server.url), namespace="x"), every=0)
    with pytest.raises(ac.ConfigError, match="log_summary needs"):
        log_summary(object(), every=1)


# -- the logger ------------------------------------------------------------------------------
class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def root_handler() -> Iterator[_Keep]:
    root = logging.getLogger()
    handler, level = _Keep(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # an application that logs everything of its own
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


def test_logger_is_silent_below_warning_by_default(root_handler: _Keep) -> None:
    log = logging.getLogger("asynccache")
    assert log.level == logging.WARNING
    log.info("an info line")
    log.debug("a debug line")
    policy = ac.AsyncKVCache(ac.connect("memory://"), namespace="quiet").policy
    for _ in range(3):  # the first is a WARNING, the others DEBUG ("failed again")
        policy.failed("node", "get", ac.StoreTimeout("slow"))
    mine = [r for r in root_handler.records if r.name.startswith("asynccache")]
    assert [r.levelno for r in mine] == [logging.WARNING]
    assert "get failed" in mine[0].getMessage()


def test_without_logging_configured_the_warning_still_reaches_stderr() -> None:
    """An application that never configured logging still hears, once, that the cache
    failed -- and sees nothing else of ours."""
    script = (
        "import asynccache as ac, logging\n"
        "logging.getLogger('asynccache').info('an info line')\n"
        "policy = ac.AsyncKVCache(ac.connect('memory://'), namespace='loud').policy\n"
        "for _ in range(3):\n"
        "    policy.failed('node', 'get', ac.StoreTimeout('slow'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "get failed" in lines[0], done.stderr
    assert "an info line" not in done.stderr


# -- logged once per job -------------------------------------------------------------------
def test_board_claim_is_won_by_exactly_one_process() -> None:
    board = StatsBoard("test-" + secrets.token_hex(6))
    board.label("claims")  # made by its owner, as a pipe's is when it is built
    try:
        ctx = multiprocessing.get_context("fork")
        children = [ctx.Process(target=_claim, args=(board,)) for _ in range(4)]
        for child in children:
            child.start()
        for child in children:
            child.join(10)
        assert sorted(c.exitcode for c in children) == [0, 1, 1, 1]
        assert not board.claim("get-StoreTimeout")  # the job already logged it
        assert board.claim("get-StoreUnavailable")  # another kind is new
    finally:
        board.remove()


def _claim(board: StatsBoard) -> None:
    os._exit(0 if board.claim("get-StoreTimeout") else 1)


_JOB = """
import logging, sys
import torch
from torch.utils.data import DataLoader
import asynccache as ac

logging.basicConfig(filename=sys.argv[2], level=logging.DEBUG,
                    format="%(process)d %(levelname)s %(name)s %(message)s")
logging.getLogger("asynccache").setLevel(logging.DEBUG)  # its "failed again" lines too


class Source(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return i


if __name__ == "__main__":
    dp = ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(sys.argv[1], timeout=0.3),
                                    namespace="once-per-job")
    loader = DataLoader(dp, batch_size=8, num_workers=2, persistent_workers=False,
                        collate_fn=list, multiprocessing_context="fork")
    for _epoch in range(2):
        assert sorted(i for batch in loader for i in batch) == list(range(64))
    import time
    time.sleep(1.5)  # the last workers' final reports
    stats = dp.stats()
    print(stats["errors"], stats["unavailable"], len(dp.stats(per_process=True)))
"""


def test_a_dead_store_is_logged_once_per_job(tmp_path: Path) -> None:
    """2 workers x 2 epochs (fresh workers each epoch) all fail: one WARNING per kind for
    the whole job, while every worker's failures are still counted."""
    with socket.socket() as s:  # a port nobody listens on: every connect is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script, log = tmp_path / "job.py", tmp_path / "job.log"
    script.write_text(textwrap.dedent(_JOB))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(ac.__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), f"redis://127.0.0.1:{port}/0",
                           str(log)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    errors, unavailable, processes = map(int, done.stdout.split())
    lines = log.read_text().splitlines()
    warnings = [line for line in lines if " WARNING asynccache " in line]
    kinds = [line.split("asynccache: ", 1)[1].split(" failed")[0] for line in warnings]
    assert warnings and len(kinds) == len(set(kinds)), warnings  # each kind once
    pids = {line.split()[0] for line in lines if " asynccache " in line}
    assert len(pids) > 1  # several workers failed and logged (DEBUG) ...
    assert processes == 5 and unavailable >= 4 and errors >= unavailable  # ... and counted


# -- the catalog: every number reaches Prometheus -----------------------------------------
def test_every_counter_of_a_pipe_is_a_metric_with_its_value(
        redis_server: Any, namespace: str, registry: CollectorRegistry) -> None:
    """Each number of the catalog that is a metric of its own is exported with the value
    ``stats()`` gives (counters ``_total``, the two sizes as gauges), nonzero ones too."""
    from asynccache.observe.catalog import CATALOG, exported

    dp = ac.AsyncKVCacheMapDataPipe(list(range(N)), ac.connect(redis_server.url),
                                    namespace=namespace)
    CacheCollector(dp, registry=registry)
    for loader_epoch in range(2):  # misses computed, then hits read ahead
        for _ in DataLoader(dp, batch_size=BATCH, shuffle=bool(loader_epoch)):
            pass
        dp.flush()
    stats = dp.stats()
    got = scrape(registry)
    labels = {"namespace": namespace, "store": dp.client.safe_url}
    nonzero = 0
    for stat in exported():
        name = f"asynccache_{stat.metric}" + ("" if stat.kind == "size" else "_total")
        assert value(got, name, **labels) == stats.get(stat.name, 0), stat.name
        nonzero += stats.get(stat.name, 0) > 0
    assert nonzero >= 8  # hits, misses, computed, sets, bytes, batches, ...
    unknown = set(stats) - {"hit_rate"} - {s.name for s in CATALOG}
    assert not unknown, f"numbers of stats() missing from the catalog: {unknown}"
    dp.close()
