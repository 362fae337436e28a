"""Latency histograms: buckets, exactness under threads, quantiles, the board's row form."""

from __future__ import annotations

import threading

import pytest

from asynccache.observe.histogram import BOUNDS, Histograms, Latency, merge

MS = 1_000_000  # ns


def test_a_duration_falls_in_the_first_bucket_whose_bound_it_does_not_exceed() -> None:
    h = Histograms()
    h.record("read", 0)
    h.record("read", 100_000)          # exactly 0.1 ms: the first bucket (le)
    h.record("read", 100_001)          # just over: the second
    h.record("read", 11_000 * MS)      # over 10 s: the overflow bucket
    h.record("write", 3 * MS)
    read, write = h.snapshot()["read"], h.snapshot()["write"]
    assert read.counts[0] == 2 and read.counts[1] == 1 and read.counts[-1] == 1
    assert read.count == 4 and read.sum_ns == 100_000 + 100_001 + 11_000 * MS
    assert write.count == 1 and write.counts[BOUNDS.index(0.005)] == 1


def test_exact_under_threads_and_after_threads_end() -> None:
    h = Histograms()

    def work(n: int) -> None:
        for i in range(20_000):
            h.record("read", (i % 7) * MS + n)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h.record("read", 1)  # this thread's shard stays live; the four ended ones are folded
    snap = h.snapshot()["read"]
    assert snap.count == 80_001
    assert snap.sum_ns == 1 + sum((i % 7) * MS + n for n in range(4) for i in range(20_000))
    assert h.snapshot()["read"] == snap  # folding the ended threads' rows lost nothing


def test_cumulative_is_monotone_and_ends_at_the_count() -> None:
    h = Histograms()
    for ms in (0.05, 0.3, 0.3, 2, 40, 700, 20_000):
        h.record("read", int(ms * MS))
    cumulative = h.snapshot()["read"].cumulative()
    counts = [n for _bound, n in cumulative]
    assert counts == sorted(counts) and counts[-1] == 7
    assert cumulative[-1][0] == float("inf") and len(cumulative) == len(BOUNDS) + 1


def test_quantiles_interpolate_inside_their_bucket() -> None:
    h = Histograms()
    for _ in range(100):
        h.record("read", int(0.75 * MS))  # all in (0.5 ms, 1 ms]
    lat = h.snapshot()["read"]
    assert lat.quantile(0.5) == pytest.approx(0.00075)
    assert 0.0005 < lat.quantile(0.99) <= 0.001  # type: ignore[operator]
    assert Latency().quantile(0.5) is None
    h.record("read", 60_000 * MS)
    assert h.snapshot()["read"].quantile(1.0) == BOUNDS[-1]  # "over 10 s" is all we know
    with pytest.raises(ValueError):
        lat.quantile(1.5)


def test_rows_round_trip_and_sums_merge() -> None:
    h = Histograms()
    h.record("read", 2 * MS)
    h.record("write", 7 * MS)
    snap = h.snapshot()
    again = {kind: Latency.from_row(lat.to_row()) for kind, lat in snap.items()}
    assert again == snap
    total = merge([snap, again])
    assert total["read"].count == 2 and total["write"].sum_ns == 14 * MS
    with pytest.raises(ValueError):
        Latency.from_row([1, 2, 3])  # another version's row: refused, never misread
