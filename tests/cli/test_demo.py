"""``asynccache demo`` end to end: a subprocess, real DataLoader workers, a real server.

Only outcomes that do not depend on the machine's speed are asserted: exit codes, which
rows the table has, how many items were computed, hit rates, and that every epoch
returned the same data. Timings are printed by the demo, never checked here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asynccache.__main__ import main
from asynccache.testing import servers

CONFIGS = ("no cache", "dict per worker", "async_kv_cache")
RUN_TIMEOUT = 120  # seconds; a --quick run takes ~10 s on two busy cores


def run_cli(*args: str, program: tuple[str, ...] | None = None) -> subprocess.CompletedProcess[str]:
    command = program or (sys.executable, "-m", "asynccache")
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def table(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """The summary table as {(configuration, epoch): {column: cell}}."""
    lines = stdout.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("configuration"))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=True))
        rows[cells["configuration"], cells["epoch"]] = cells
    return rows


def test_quick_demo_on_a_private_server(tmp_path: Path) -> None:
    report = tmp_path / "demo.json"
    done = run_cli("demo", "--quick", "--out", str(report))

    rows = table(done.stdout)
    assert set(rows) == {(c, e) for c in CONFIGS for e in ("cold", "warm")}
    assert rows["no cache", "warm"]["computed"] == "400/400"
    assert rows["no cache", "warm"]["hit rate"] == "-"
    # Non-persistent workers start with an empty dict: the warm epoch computes it all again.
    assert rows["dict per worker", "warm"]["hit rate"] == "0%"
    assert rows["async_kv_cache", "cold"]["computed"] == "400/400"
    assert rows["async_kv_cache", "warm"]["computed"] == "0/400"
    assert rows["async_kv_cache", "warm"]["hit rate"] == "100%"
    assert all(row["peak RSS/worker"].endswith(" MiB") for row in rows.values())
    assert "store: private " in done.stdout
    assert "warm/cold" in done.stdout

    document = json.loads(report.read_text())
    assert document["ok"] is True and document["data_ok"] is True
    assert document["items"] == 400
    assert document["item_cost_ms"] > 0
    assert len(document["results"]) == 6
    assert set(document["summary"]) == {
        "async_kv_cache_warm_over_cold",
        "async_kv_cache_speedup_vs_no_cache",
    }
    assert all(len(r["peak_rss_mib"]) == 2 for r in document["results"])


def test_demo_uses_an_existing_store_given_by_url() -> None:
    """... and ``--json`` prints the results on stdout, as one document, like every other
    command; what the demo says as it goes is on stderr then."""
    with servers.start_redis() as server:
        done = run_cli("demo", "--quick", "--items", "160", "--url", server.url, "--json")

        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1, done.stdout
        document = json.loads(lines[0])
        assert document["ok"] is True and "nothing started" in document["store"]
        warm = next(r for r in document["results"]
                    if (r["config"], r["epoch"]) == ("async_kv_cache", "warm"))
        assert warm["hit_rate"] == 1.0 and warm["computed"] == 0
        assert "store: existing store" in done.stderr
        assert server.call("DBSIZE") == 160  # the values went to this store
        _, keys = server.call("SCAN", 0, "COUNT", 1000)
        assert 0 < server.call("TTL", keys[0]) <= 3600  # and expire there


def test_help_and_console_script() -> None:
    done = run_cli("--help")
    assert "demo" in done.stdout
    script = Path(sys.executable).with_name("asynccache")
    done = run_cli("demo", "--help", program=(str(script),))
    assert "--url" in done.stdout
    assert "--start-method" in done.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--workers", "0"],
        ["demo", "--prefetch", "-1"],
        ["demo", "--server", "redis", "--url", "redis://127.0.0.1:1/0"],
        ["demo", "--start-method", "thread"],
        ["nonsense"],
        [],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: asynccache" in capsys.readouterr().err


def test_without_the_demo_extra_one_line_names_it() -> None:
    """torch missing (``sys.modules["torch"] = None`` makes importing it fail): the demo
    exits 1 with one line naming the extra, and its progress line is gone first."""
    script = ("import sys; sys.modules['torch'] = None\n"
              "from asynccache.__main__ import main\n"
              "sys.exit(main(['demo', '--quick']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, check=False)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        "asynccache demo: error: `asynccache demo` needs the package 'torch', which is not "
        "installed: pip install 'asynccache[demo]'"]
    assert done.stdout == ""


def test_json_takes_no_path_any_more(capsys: pytest.CaptureFixture[str]) -> None:
    """``--json PATH`` was a file; now ``--json`` is stdout and ``--out`` the file."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--json", "out.json"])
    assert exc.value.code == 2
    assert "unrecognized arguments: out.json" in capsys.readouterr().err


def test_a_bad_url_is_an_error_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--items", "8", "--url", "nope://somewhere"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("asynccache demo: error: unknown scheme 'nope'")
