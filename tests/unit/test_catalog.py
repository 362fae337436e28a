"""The one catalog of counters (`asynccache.observe.catalog`): the docs' table is made
from it, and every number a cache, a pipe or a node reports is in it."""

from __future__ import annotations

from pathlib import Path

import pytest

import asynccache as ac
from asynccache.observe import catalog
from asynccache.observe.stats import HIT_RATE

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_docs_table_is_the_catalog() -> None:
    assert catalog.markdown_table() in DOCS.read_text(), (
        "docs/configuration.md's counters table differs from the catalog: paste "
        "asynccache.observe.catalog.markdown_table() in its place")


def test_names_and_metric_names_are_unique() -> None:
    names = [s.name for s in catalog.CATALOG]
    metrics = [s.metric for s in catalog.CATALOG if s.metric is not None]
    assert len(names) == len(set(names))
    assert len(metrics) == len(set(metrics))


def test_a_number_that_is_not_a_metric_says_why() -> None:
    for stat in catalog.CATALOG:
        assert (stat.metric is None) == bool(stat.why_not), stat.name


@pytest.mark.anyio
async def test_every_number_a_cache_reports_is_in_the_catalog() -> None:
    async with ac.AsyncKVCache(ac.connect("memory://catalog"), "catalog-v1") as cache:
        await cache.set(1, "one")
        await cache.get(1)
        reported = set(cache.stats()) - {HIT_RATE}
    known = {s.name for s in catalog.CATALOG}
    assert reported <= known, reported - known
    assert {s.name for s in catalog.CATALOG if "cache" in s.owners} <= reported
