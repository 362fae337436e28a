"""``asynccache bench`` end to end, in a few seconds (``--smoke``): real private servers,
every benchmark module of ours, the latency proxy process, tables, JSON and plots.

Only the shape of the output is checked -- which files and keys exist, that every
ratio is a positive number -- never a timing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asynccache.__main__ import main

OURS = ("goals", "core", "datapipe", "latency", "network", "distance", "local")


def ratios(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every number stored under a key that contains "ratio", at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}/{key}"
            if "ratio" in str(key):
                yield from _numbers(value, where)
            else:
                yield from ratios(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from ratios(value, f"{path}[{i}]")


def _numbers(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{path}[{i}]")
    elif node is not None and not isinstance(node, str):
        yield path, node


@pytest.mark.timeout(180)
def test_smoke_run_writes_tables_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["bench", "--smoke", "--no-progress", "--out", str(tmp_path), "--only", ",".join(OURS)]
    )
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, captured.err[-6000:]  # a module's failure and traceback go to stderr

    doc = json.loads((tmp_path / "results.json").read_text())
    assert {"schema", "mode", "machine", "modules", "headline", "elapsed_s"} <= set(doc)
    assert doc["mode"] == "smoke"
    machine = doc["machine"]
    assert machine["cpu_model"] and machine["cpus_usable"] >= 1 and machine["python"]
    assert {s["kind"] for s in machine["servers"].values()} >= {"redis", "memcached"}
    assert all(s["version"] for s in machine["servers"].values())
    assert set(doc["modules"]) == set(OURS)
    for name, entry in doc["modules"].items():
        assert "error" not in entry, f"{name}: {entry.get('error')}"
        assert entry["results"], name
        assert entry["plots"], f"{name} made no plot"
        for plot in entry["plots"]:
            assert Path(plot).parent == tmp_path and Path(plot).stat().st_size > 0

    latency = doc["modules"]["latency"]["results"]
    sizes = {block["value_bytes"] for block in latency["by_size"]}
    assert sizes == {100, 4096, 65536, 1 << 20}
    block = latency["by_size"][0]
    roles = {case["role"] for case in block["cases"].values()}
    assert roles == {"asynccache", "dict", "naive", "floor", "aiocache"}
    for case in block["cases"].values():
        assert {"p50", "p95", "p99"} <= set(case["item_us"]) and case["items_per_s"] > 0
        assert {"p50", "p95", "p99"} <= set(case["batch_us"]) and case["mb_per_s"] > 0
    levels = doc["modules"]["network"]["results"]["levels"]
    assert {level["rtt_added_s"] for level in levels} >= {0.0, 1e-3}
    assert all(level["ping_us"] > 0 for level in levels)
    distance = doc["modules"]["distance"]["results"]["levels"]
    assert {(lv["value_bytes"], lv["rtt_added_s"]) for lv in distance} == {
        (4096, 0.0), (4096, 2e-3), (1 << 20, 0.0), (1 << 20, 2e-3)}
    assert all(lv["items_per_s"] > 0 and lv["window_items"] > 0 for lv in distance)
    assert [lv["vs_plus_0"] for lv in distance if lv["rtt_added_s"] == 0.0] == [1.0, 1.0]
    local = doc["modules"]["local"]["results"]
    assert {block["value_bytes"] for block in local["by_size"]} == {4096, 256 * 1024}
    for block in local["by_size"]:
        assert set(block["cases"]) == {"lmdb", "redis-unix"}
        assert all(v > 0 for case in block["cases"].values() for v in case.values())

    goals = doc["modules"]["goals"]["results"]
    assert goals["wire"]["mb_per_s"] > 0
    rows = {row["goal"]: row for row in goals["summary"]}
    for size in ("256 KiB", "1 MiB", "4 MiB"):
        assert f"{size} dp[i] MB/s vs per-key GET" in rows
    assert "3-node cluster dp[i] vs one node, +0.2 ms" in rows
    assert "memcached 100 B dp[i] vs emcache" in rows
    assert "cold DataLoader epoch vs no cache (lower is better)" in rows
    assert "cold, no set_order DataLoader epoch vs no cache (lower is better)" in rows
    assert rows["2 ranks x 2 workers: warm reads served by read-ahead"]["ratio"] <= 1.0
    assert "tiered warm epoch vs far alone, +1 ms (lower is better)" in rows
    for size in ("4 KiB", "100 KiB", "1 MiB"):  # the README's loop: limit, diskcache, RSS
        assert f"warm DataLoader epoch, {size}, asynccache, redis vs diskcache" in rows
        assert (f"warm DataLoader epoch, {size}, asynccache, lmdb vs the loader's own limit"
                in rows)
        rss = rows[f"warm DataLoader epoch, {size}, asynccache, redis: peak RSS per worker "
                   "vs the loader's limit (lower is better)"]
        assert rss["peer_value"] > 50 and rss["ours_value"] > 50  # MiB: a real worker's
    assert "shuffle=True, persistent workers: warm reads served by read-ahead" in rows
    assert set(goals["samplers"]["cases"]) >= {"own RNG (not followable), fresh workers"}
    copied = {goal: row for goal, row in rows.items() if "bytes copied per byte" in goal}
    for store in ("redis", "memcached"):  # issue 41's slice 4: copies counted, 0 is right
        for phase in ("pipe write", "pipe read", "set_many", "get_many"):
            for kind in ("bytes", "float32 array"):
                row = copied[f"1 MiB {kind}, {store} {phase}: bytes copied per byte "
                             "(lower is better)"]
                assert 0 <= row["ours_value"] < 20, row  # a copy or a few, not per chunk
    assert all(row["ours_value"] > 0 and row["peer_value"] > 0 for goal, row in rows.items()
               if goal not in copied)
    assert goals["cold"]["computed_per_rep"] == [goals["cold"]["items"]] * len(
        goals["cold"]["computed_per_rep"])  # cold: each item computed once, warm: none

    found = list(ratios(doc))
    assert len(found) > 50
    bad = [(p, v) for p, v in found if not (isinstance(v, int | float) and math.isfinite(v))]
    counts = {f"/modules/goals/results/summary[{i}]/ratio"
              for i, row in enumerate(goals["summary"]) if row["goal"] in copied}
    bad += [(p, v) for p, v in found if isinstance(v, int | float) and v <= 0
            and p not in counts]
    assert not bad, bad[:10]
    assert doc["headline"]["direct"] and doc["headline"]["network"]
    assert "sentence" in doc["headline"]

    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# asynccache benchmarks")
    assert "## Headline" in summary and "| store value" in summary
    assert "p99 per item at the consumer" in summary
    assert machine["cpu_model"] in summary
    assert "| store / value / case" in out  # the tables are printed too
    assert len(list(tmp_path.glob("*.png"))) >= 5


def test_unknown_benchmark_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--only", "latency,nosuch"])
    assert exc.value.code == 2
    assert "nosuch" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "module", "extra"), [
    (["bench", "--smoke", "--only", "core", "--no-progress"], "matplotlib", "bench"),
    (["bench", "--smoke", "--no-progress"], "aiomcache", "bench"),
    (["demo", "--quick", "--no-progress"], "psutil", "demo"),
])
def test_a_missing_optional_dependency_names_the_extra(argv: list[str], module: str,
                                                       extra: str, tmp_path: Path) -> None:
    """``asynccache bench`` with only the demo extra installed: one line naming the extra
    to install and exit code 1, not a ModuleNotFoundError traceback; before any server
    starts or any file is written."""
    import subprocess
    import sys

    out = tmp_path / "results"
    if argv[0] == "bench":
        argv = [*argv, "--out", str(out)]
    script = (f"import sys; sys.modules[{module!r}] = None\n"
              "from asynccache.__main__ import main\n"
              f"sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert f"pip install 'asynccache[{extra}]'" in done.stderr
    assert module in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_services_smoke_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--only services``: three aiohttp services on one private Redis under wrk, the
    stampede count and the import cost; shapes and counts only, no timing."""
    import shutil

    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (apt-get install wrk)")
    code = main(["bench", "--smoke", "--no-progress", "--out", str(tmp_path),
                 "--only", "services", "--servers", "redis"])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads((tmp_path / "results.json").read_text())
    entry = doc["modules"]["services"]
    assert "error" not in entry and "skipped" not in entry, entry
    results = entry["results"]
    assert set(results["services"]) == {"asynccache", "aiocache", "redis"}
    for kind, row in results["services"].items():
        assert row["requests_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"], kind
        assert row["errors"] == 0, kind
        assert len(row["rounds"]) == results["config"]["rounds"]
    stampede = {k: r["stampede_computations"] for k, r in results["services"].items()}
    assert stampede["asynccache"] == 1  # concurrent get_or_compute of one key: one lookup
    assert stampede["redis"] > 1  # GET, miss, compute: every request that missed
    imported = results["import"]
    assert imported["seconds"] > 0 and imported["rss_mib"] > 0
    assert imported["torch_imported"] is False and imported["numpy_imported"] is False
    assert all(v > 0 for r in results["ratios"].values() for v in r.values())
    assert "| asynccache get_or_compute" in out and "`import asynccache`" in out
    assert {Path(p).name for p in entry["plots"]} == {
        "services_requests_per_s.png", "services_latency_ms.png"}
