"""`asynccache stats` says where its hit rate comes from in words that fit the counts."""

from __future__ import annotations

from typing import Any

import pytest

from asynccache.cli.stats import _text


def doc(**counts: Any) -> dict[str, Any]:
    base = {"prefix": "ac:ns:", "url": "redis://127.0.0.1:1/0", "keys": 4, "bytes": 400,
            "values": 4, "chunks": 0, "leases": 0, "hashed": 0, "namespace": "ns",
            "boards": 1, "processes": 0, "exited_processes": 0, "hits": 0, "misses": 0,
            "errors": 0, "hit_rate": None, "ignored_files": 0}
    return base | counts


@pytest.mark.parametrize(("counts", "expected"), [
    ({"boards": 0}, "no process on this machine has namespace 'ns' open"),
    ({}, "no process has reported yet (1 pipe or node open for 'ns')"),
    ({"boards": 2}, "no process has reported yet (2 pipes or nodes open for 'ns')"),
    ({"exited_processes": 2, "hits": 5, "misses": 5, "hit_rate": 0.5},
     "hit rate 50.0% (hits 5, misses 5, errors 0) from 2 exited processes on this machine"),
    ({"processes": 1, "hits": 3, "misses": 1, "hit_rate": 0.75},
     "from 1 running process on this machine"),
    ({"processes": 1, "exited_processes": 2, "hits": 1, "misses": 1, "hit_rate": 0.5},
     "from 3 processes (1 running, 2 exited) on this machine"),
])
def test_the_sources_of_the_hit_rate(counts: dict[str, Any], expected: str) -> None:
    text = _text(doc(**counts))
    assert expected in text
    assert "0 running" not in text and "from 0" not in text
