"""Damaged LMDB environments never kill the process: truncated or overwritten data.mdb
files, read in a child process (a crash there is a failed test, not a lost test run), are
counted misses with the source's values; ``on_error="raise"`` raises a StoreError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import asynccache as ac
from asynccache.clients.lmdb import LmdbClient


# -- the consumer-side connection -------------------------------------------------------------
def test_a_failed_consumer_read_drops_the_replies_it_held(tmp_path: Path) -> None:
    """A read that raises closes the consumer-side "connection" like a broken socket: the
    read-ahead counts everything queued on it as lost, so a reply kept past the failure
    would be handed to a later request (an IndexError in dp[i], or a wrong value)."""

    class Failing(LmdbClient):
        fail = False

        def read_now(self, keys: Any) -> list[bytes | None]:
            if self.fail:
                raise ac.StoreError("damaged")
            return super().read_now(keys)

    conn = Failing(path=str(tmp_path / "cache")).consumer_reads().connections[0]
    conn.send_get([b"a"])
    conn.client.fail = True
    with pytest.raises(ac.StoreError):
        conn.send_get([b"b"])
    assert conn.poll() == []
