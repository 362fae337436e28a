"""Latency histograms of store requests, exact under threads, cheap enough for the read path.

Why it is built this way: docs/design.md, "Latency histograms".
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .shards import ThreadShards

__all__ = ["BOUNDS", "KINDS", "Histograms", "Latency", "merge"]

#: Upper bounds of the buckets, in seconds (a request of exactly a bound falls in its
#: bucket, as Prometheus' ``le``); one more bucket counts what took longer than 10 s.
BOUNDS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)
_BOUNDS_NS: tuple[int, ...] = tuple(round(b * 1e9) for b in BOUNDS)
#: What is timed: multi-gets (loop side and consumer side) and write requests.
KINDS = ("read", "write")
_SLOTS = len(BOUNDS) + 1  # bucket counts; the row's last item is the sum in ns


@dataclass(frozen=True)
class Latency:
    """One histogram, as a snapshot: ``counts[i]`` requests took at most ``BOUNDS[i]``
    seconds and more than the bound before it; ``counts[-1]`` took over 10 s."""

    counts: tuple[int, ...] = (0,) * _SLOTS
    sum_ns: int = 0

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def sum(self) -> float:
        """Total time of the requests, in seconds."""
        return self.sum_ns / 1e9

    def cumulative(self) -> list[tuple[float, int]]:
        """``[(upper bound, requests at most that long)]``, ``inf`` last (Prometheus)."""
        out, running = [], 0
        for bound, n in zip((*BOUNDS, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile in seconds, interpolated inside its bucket; None if empty.

        Past the last bound it answers the last bound: "over 10 s" is all we know.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be between 0 and 1, got {q!r}")
        total = self.count
        if total == 0:
            return None
        rank = q * total
        running = 0
        for i, n in enumerate(self.counts):
            if n and running + n >= rank:
                if i == len(BOUNDS):
                    return BOUNDS[-1]
                low = BOUNDS[i - 1] if i else 0.0
                return low + (BOUNDS[i] - low) * max(rank - running, 0.0) / n
            running += n
        return BOUNDS[-1]

    def __add__(self, other: Latency) -> Latency:
        return Latency(tuple(a + b for a, b in zip(self.counts, other.counts)),
                       self.sum_ns + other.sum_ns)

    # -- plain form, for the stats board (JSON) ---------------------------------------
    def to_row(self) -> list[int]:
        return [*self.counts, self.sum_ns]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> Latency:
        """The inverse of `to_row()`; a row of another length is refused (ValueError)."""
        if len(row) != _SLOTS + 1:
            raise ValueError(f"a latency row has {_SLOTS + 1} ints, got {len(row)}")
        values = [int(v) for v in row]
        return cls(tuple(values[:-1]), values[-1])


def merge(snapshots: Iterable[Mapping[str, Latency]]) -> dict[str, Latency]:
    """The sum of several ``{kind: Latency}`` (threads, processes, caches)."""
    total: dict[str, Latency] = {kind: Latency() for kind in KINDS}
    for snapshot in snapshots:
        for kind, latency in snapshot.items():
            total[kind] = total.get(kind, Latency()) + latency
    return total


class Histograms:
    """One latency histogram per kind of request, one shard per thread
    (`asynccache.observe.shards`)."""

    def __init__(self, kinds: Iterable[str] = KINDS) -> None:
        self.kinds = tuple(kinds)
        self._shards = ThreadShards(self._rows, _fold)

    def _rows(self) -> dict[str, list[int]]:
        return {kind: [0] * (_SLOTS + 1) for kind in self.kinds}

    def record(self, kind: str, elapsed_ns: int) -> None:
        """One request of ``kind`` took ``elapsed_ns`` (from ``time.perf_counter_ns``)."""
        row = self._shards.mine()[kind]
        row[bisect_left(_BOUNDS_NS, elapsed_ns)] += 1
        row[-1] += elapsed_ns

    def snapshot(self) -> dict[str, Latency]:
        """``{kind: Latency}`` summed over every thread (every kind listed, even empty)."""
        return {kind: Latency.from_row(row) for kind, row in self._shards.total().items()}


def _fold(into: dict[str, list[int]], shard: dict[str, list[int]]) -> None:
    for kind, row in shard.items():
        target = into[kind]
        for i, value in enumerate(list(row)):  # list(): one C-level copy of a live row
            target[i] += value
