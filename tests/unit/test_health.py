"""The failure policy: per-node back-off, counting, logging once, raise vs fallback."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import asynccache as ac
from asynccache.cache.health import BACKOFF_START, FailurePolicy
from asynccache.observe.stats import Counters


def policy(on_error: str = "fallback") -> FailurePolicy:
    return FailurePolicy(on_error, Counters(), "redis://test")  # type: ignore[arg-type]


def test_a_failed_node_backs_off_alone() -> None:
    p = policy()
    p.failed("a", "get", ac.StoreTimeout("slow"))
    assert p.down() == {"a"} and "a" in p.down() and "b" not in p.down()
    stats = p.counters.snapshot()
    assert stats["errors"] == 1 and stats["timeouts"] == 1


def test_back_off_grows_while_probes_fail_and_resets_on_success(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    p = policy()
    p.failed("a", "get", ac.StoreUnavailable("refused"))
    p.failed("a", "get", ac.StoreUnavailable("refused"))  # same burst: not escalated
    assert p._until["a"] == 1000.0 + BACKOFF_START
    now[0] += BACKOFF_START
    assert "a" not in p.down()  # the back-off ended: the next request is a probe
    p.failed("a", "get", ac.StoreUnavailable("still refused"))
    assert p._until["a"] == now[0] + 2 * BACKOFF_START
    p.succeeded("a")
    assert "a" not in p.down() and "a" not in p._backoff


def test_rejections_and_decode_errors_do_not_back_off() -> None:
    p = policy()
    p.failed("a", "set", ac.StoreRejected("OOM"))
    p.decode_failed(ac.DecodeError("garbage"))
    p.decode_failed(ac.FormatMismatch("version 1"))
    assert p.down() == frozenset()
    stats = p.counters.snapshot()
    assert stats["rejected"] == 1 and stats["decode_errors"] == 1
    assert stats["outdated"] == 1 and stats["errors"] == 2  # another version: not an error


def test_raise_mode_never_skips_and_never_logs(caplog: pytest.LogCaptureFixture) -> None:
    p = policy("raise")
    with caplog.at_level(logging.DEBUG, logger="asynccache"):
        p.failed("a", "get", ac.StoreTimeout("slow"))
    assert p.down() == frozenset() and "a" not in p.down()
    assert p.counters.snapshot()["errors"] == 1  # counted in raise mode too
    assert caplog.records == []


def test_each_kind_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    p = policy()
    with caplog.at_level(logging.WARNING, logger="asynccache"):
        for _ in range(50):
            p.failed("a", "get", ac.StoreTimeout("slow"))
            p.failed("b", "get", ac.StoreTimeout("slow"))
            p.failed("a", "set", ac.StoreUnavailable("reset"))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_counters_are_exact_under_threads() -> None:
    counters = Counters()

    def work() -> None:
        for _ in range(20_000):
            counters.shard()["hits"] += 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    mid = counters.snapshot()["hits"]  # readable while being written
    for t in threads:
        t.join()
    assert 0 <= mid <= 160_000
    assert counters.snapshot()["hits"] == 160_000
    assert counters.snapshot()["hits"] == 160_000  # ended threads' shards are folded once


def test_bad_signatures_have_their_own_counter() -> None:
    p = policy()
    p.decode_failed(ac.SignatureError("not signed by any of our secrets"))
    stats = p.counters.snapshot()
    assert stats["bad_signatures"] == 1 and stats["errors"] == 1
    assert stats["decode_errors"] == 0
