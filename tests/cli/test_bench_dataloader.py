"""``asynccache.bench.dataloader`` on a tiny dataset: structure and the counts, not speed.

One quick run (largest size 32 items, so sizes 8, 16, 32) with real DataLoader workers
and a private redis-server, shared by the tests of this module. Only outcomes that do
not depend on the machine's speed are asserted: which results exist, how many items
were computed in each epoch, that every epoch returned the same data, and that the
table and plots are written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asynccache.bench import dataloader as bench

ITEMS = 32
SIZES = [8, 16, 32]
DICT, ASYNC = bench.CACHES


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-dataloader")


@pytest.fixture(scope="module")
def results(out_dir: Path) -> dict[str, Any]:
    return bench.run(quick=True, out_dir=out_dir, progress=False, items=ITEMS)


def runs(results: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    found = [r for r in results["runs"] if all(r[k] == v for k, v in match.items())]
    assert found, match
    return found


def test_result_structure(results: dict[str, Any], out_dir: Path) -> None:
    assert results["sizes"] == SIZES
    assert results["data_ok"] is True
    machine = results["machine"]
    for key in ("cpu_model", "cpus_usable", "python", "torch", "server_kind", "start_method"):
        assert machine[key], key
    assert machine["server_version"]  # a private redis-server answered INFO
    assert results["dataset"]["item_cost_ms"] > 0
    combos = {(r["cache"], r["items"], r["workers"], r["persistent"]) for r in results["runs"]}
    assert combos == {
        (cache, n, workers, persistent)
        for cache in (DICT, ASYNC)
        for n in SIZES
        for workers, persistent in bench.LOADERS
    }
    assert {(w, p) for w, p in bench.LOADERS} == {
        (0, False),
        (2, False),
        (2, True),
        (4, False),
        (4, True),
    }
    for record in results["runs"]:
        assert [e["epoch"] for e in record["epochs"]] == ["cold", "warm"]
        assert record["peak_rss_per_worker_mib"] > 0
        assert record["total_rss_mib"] >= record["peak_rss_per_worker_mib"]
        assert record["cached_mib"] > 0
        for epoch in record["epochs"]:
            assert epoch["seconds"] > 0
            assert len(epoch["peak_rss_mib"]) == max(1, record["workers"])
        if record["cache"] == ASYNC:
            assert record["store_mib"] > 0  # the data went to the store
    # JSON-able, and what run() wrote is what it returned.
    assert json.loads(json.dumps(results)) == results
    assert json.loads((out_dir / bench.RESULTS_NAME).read_text()) == results


def test_every_cold_epoch_computes_everything(results: dict[str, Any]) -> None:
    for record in results["runs"]:
        cold = record["epochs"][0]
        assert cold["computed"] == record["items"], record
        assert cold["hit_rate"] == 0


def test_async_kv_cache_warm_epoch_computes_nothing(results: dict[str, Any]) -> None:
    for record in runs(results, cache=ASYNC):
        warm = record["epochs"][1]
        assert warm["computed"] == 0, record
        assert warm["hit_rate"] == 1


def test_dict_warm_epoch_with_fresh_workers_recomputes_everything(
    results: dict[str, Any],
) -> None:
    for record in runs(results, cache=DICT, persistent=False):
        warm = record["epochs"][1]
        if record["workers"] == 0:  # the main process keeps its dict between epochs
            assert warm["computed"] == 0
        else:
            assert warm["computed"] == record["items"], record
            assert warm["hit_rate"] == 0
    for record in runs(results, cache=DICT, persistent=True):
        assert 0 <= record["epochs"][1]["computed"] <= record["items"]


def test_table(results: dict[str, Any]) -> None:
    text = bench.table(results)
    for heading in ("(1) Memory", "(2) Sharing", "(3) Epoch time"):
        assert heading in text
    assert results["machine"]["cpu_model"] in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    header_and_rule = 2 * 3
    assert len(rows) == header_and_rule + len(SIZES) * 5 + 5 + 5


def test_plot_writes_pngs(results: dict[str, Any], tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  (the bench extra; CI installs it)
    paths = bench.plot(results, tmp_path / "plots")
    assert len(paths) == 3
    for path in paths:
        assert path.suffix == ".png" and path.parent == tmp_path / "plots"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
