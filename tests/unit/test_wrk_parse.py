"""The `services` benchmark's reading of wrk's report, and its rotation of services."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")  # asynccache.bench's plots

from asynccache.bench._common import BenchError
from asynccache.bench.services import parse_wrk, rotated

REPORT = """\
Running 6s test @ http://127.0.0.1:40123/
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     5.12ms    1.20ms  86.40ms   90.00%
    Req/Sec     6.30k   500.00     7.00k    70.00%
  Latency Distribution
     50%    4.90ms
     75%    5.50ms
     90%  820.00us
     99%    1.02s
  73800 requests in 6.00s, 85.10MB read
  Socket errors: connect 0, read 2, write 0, timeout 3
  Non-2xx or 3xx responses: 4
Requests/sec:  12300.55
Transfer/sec:     14.18MB
"""


def test_the_numbers_of_a_report() -> None:
    got = parse_wrk(REPORT)
    assert got["requests_per_s"] == 12300.55
    assert got["latency_ms"] == {"p50": 4.9, "p75": 5.5, "p90": pytest.approx(0.82),
                                 "p99": 1020.0}
    assert got["latency_mean_ms"] == 5.12 and got["latency_max_ms"] == 86.4
    assert got["requests"] == 73800 and got["duration_s"] == 6.0
    assert got["requests_per_s_per_thread"] == 6300.0
    assert got["socket_errors"] == {"connect": 0, "read": 2, "write": 0, "timeout": 3}
    assert got["non_2xx"] == 4 and got["errors"] == 9


def test_a_clean_report_has_no_errors() -> None:
    clean = "\n".join(line for line in REPORT.splitlines()
                      if "errors" not in line and "Non-2xx" not in line)
    got = parse_wrk(clean)
    assert got["errors"] == 0 and got["socket_errors"] == {} and got["non_2xx"] == 0


@pytest.mark.parametrize("text", [
    "",
    "unable to connect to 127.0.0.1:1 Connection refused\n",
    REPORT.replace("     99%    1.02s\n", ""),  # without --latency
])
def test_a_failed_run_is_an_error(text: str) -> None:
    with pytest.raises(BenchError):
        parse_wrk(text)


def test_rounds_rotate_the_order() -> None:
    kinds = ("a", "b", "c")
    assert [rotated(kinds, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
