"""A real ``torch.distributed`` job: 2 ranks (gloo, CPU, loopback) × 2 persistent
DataLoader workers each, one shared Redis (the job is ``asynccache.bench.ranks.run_job``).

What is checked: each rank reads exactly its shard of ``DistributedSampler``; every
epoch's order is followed by read-ahead in every worker (``set_epoch`` in the training
loop reaches the workers, whose copies of the sampler never see it); a warm epoch
computes nothing across ranks; with ``lease=`` a key both ranks miss at once is computed
once across the job.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from asynccache.bench import ranks
from asynccache.testing import servers

N = 384
EPOCHS = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    with servers.start_redis(prefer="redis") as server:
        return ranks.run_job(server.url, "ddp-v1", tmp_path_factory.mktemp("ddp"), n=N,
                             epochs=EPOCHS, batch=16)


def test_each_rank_reads_exactly_its_shard_every_epoch(job: list[dict[str, Any]]) -> None:
    for report in job:
        for epoch in report["epochs"]:
            assert epoch["wrong"] == 0
            assert sorted(epoch["seen"]) == sorted(epoch["expected"])
    for epoch in range(EPOCHS):  # the two shards cover the dataset
        both = set(job[0]["epochs"][epoch]["seen"]) | set(job[1]["epochs"][epoch]["seen"])
        assert both == set(range(N))
    assert job[0]["epochs"][0]["seen"] != job[0]["epochs"][1]["seen"]  # shuffled per epoch


def test_a_warm_epoch_computes_nothing_across_ranks(job: list[dict[str, Any]]) -> None:
    assert job[0]["epochs"][0]["computed"] >= N  # epoch 0: every item, by one rank or other
    for epoch in range(1, EPOCHS):
        assert job[0]["epochs"][epoch]["computed"] == 0


def test_read_ahead_follows_set_epoch_in_every_worker(job: list[dict[str, Any]]) -> None:
    for report in job:
        stats = report["stats"]
        assert stats["hits"] >= (EPOCHS - 1) * N // 2, stats
        # served by read-ahead: there before the worker asked (prefetch_hits counts hits
        # only). Before workers followed set_epoch, their copies planned epoch 0's order
        # again: 21%.
        assert stats["prefetch_hits"] >= 0.9 * stats["hits"], stats
    assert ranks.summary(job)["served_by_read_ahead"] >= 0.9


def test_with_lease_a_key_both_ranks_miss_is_computed_once(tmp_path: Path) -> None:
    """Both ranks read the same shard (world size 1 per sampler would be the same order
    on both): a one-epoch job whose ranks miss the same keys at the same time."""
    with servers.start_redis(prefer="redis") as server:
        reports = ranks.run_job(server.url, "ddp-lease", tmp_path, n=96, epochs=1, batch=8,
                                lease=10.0, same_shard=True)
    seen = [sorted(r["epochs"][0]["seen"]) for r in reports]
    assert seen[0] == seen[1] == list(range(96))
    log = ranks.computed(str(tmp_path / "computed.log"))
    assert sorted(set(log)) == list(range(96))
    assert len(log) <= 96 + 8, len(log)  # about once each (a lease can expire)


def test_the_bench_reports_the_job(job: list[dict[str, Any]]) -> None:
    case = ranks.summary(job)
    assert case["wrong"] == 0 and case["computed_warm"] == 0 and case["computed_cold"] >= N
    results = {"config": {"server": "redis", "items": N, "epochs": EPOCHS, "batch": 16,
                          "world": 2, "workers": 2, "compute_s": ranks.COMPUTE_S},
               "cases": {"set_order": case}}
    table = ranks.table(results)
    share = f"{case['served_by_read_ahead']:.0%}"
    assert re.search(rf"\| set_order +\| +{share} +\|", table), table
