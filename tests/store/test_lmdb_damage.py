"""Damaged LMDB environments never kill the process: truncated or overwritten data.mdb
files, read in a child process (a crash there is a failed test, not a lost test run), are
counted misses with the source's values; ``on_error="raise"`` raises a StoreError."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import asynccache as ac
from asynccache.store.lmdb.client import LmdbClient

SRC = Path(__file__).resolve().parents[2] / "src"
PAGE = 4096
#: values in leaf pages (100 B) and in overflow pages (4 KiB, 256 KiB)
SIZES = [100] * 300 + [4096] * 60 + [256 << 10] * 6
SOURCE = f"[bytes([i % 251]) * size for i, size in enumerate({SIZES!r})]"
NAMESPACE = "damage"

#: reads every item in a child process; prints what it saw (json) on its last line
READER = textwrap.dedent("""
    import json, os, sys
    import asynccache as ac
    path, mode = sys.argv[1], sys.argv[2]
    source = {source}
    client = ac.connect("lmdb://" + path)
    on_error = "raise" if mode == "raise" else "fallback"
    with ac.AsyncKVCacheMapDataPipe(source, client, prefetch=64, namespace={namespace!r},
                                    on_error=on_error) as dp:
        if mode == "raise":
            try:
                dp.__getitems__(list(range(len(source))))
            except ac.StoreError as exc:
                print(json.dumps({{"raised": type(exc).__name__, "message": str(exc)}}))
            else:
                print(json.dumps({{"raised": None}}))
            sys.exit(0)
        wrong = 0
        if mode == "while-open":  # hits first, then the file is cut under the open map
            wrong += sum(dp[i] != source[i] for i in range(len(source)))
            hits = dp.stats()["hits"]
            os.truncate(os.path.join(path, "data.mdb"), os.path.getsize(
                os.path.join(path, "data.mdb")) // 2)
        batch = dp.__getitems__(list(range(0, len(source), 3)))
        wrong += sum(v != source[i] for v, i in zip(batch, range(0, len(source), 3)))
        wrong += sum(dp[i] != source[i] for i in range(len(source)))
        stats = dict(dp.stats())
    if mode == "while-open":
        stats["hits_before"] = hits
    print(json.dumps({{"wrong": wrong, **stats}}))
    """).format(source=SOURCE, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A healthy environment holding every value of the source under the pipe's keys,
    written in one call (so its page layout, and what each damage below hits, is the
    same on every run)."""
    path = tmp_path_factory.mktemp("pristine") / "cache"
    code = textwrap.dedent(f"""
        import asyncio
        import asynccache as ac
        async def main():
            client = ac.connect("lmdb://{path}")
            async with ac.AsyncKVCache(client, namespace={NAMESPACE!r}) as cache:
                await cache.set_many(dict(enumerate({SOURCE})))
        asyncio.run(main())
        """)
    run_child(["-c", code])
    return path


def run_child(args: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(SRC)},
                          check=False)
    assert done.returncode == 0, (
        f"the child died (return code {done.returncode}, a negative one is the signal)"
        f":\n{done.stderr[-3000:]}")
    return done


def damaged(pristine: Path, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    """A copy of the pristine environment (data.mdb only: a fresh lock file), damaged."""
    path = tmp_path / "cache"
    path.mkdir()
    shutil.copy(pristine / "data.mdb", path / "data.mdb")
    damage(path / "data.mdb")
    return path


def read(path: Path, mode: str = "fallback") -> tuple[dict[str, Any], str]:
    done = run_child(["-c", READER, str(path), mode])
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def truncate_to(length: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(data: Path) -> None:
        os.truncate(data, length(data.stat().st_size))
    return damage


def overwrite_pages(pick: Callable[[int, random.Random], list[int]], seed: int = 0
                    ) -> Callable[[Path], None]:
    def damage(data: Path) -> None:
        rng = random.Random(seed)
        with data.open("r+b") as file:
            for page in pick(data.stat().st_size // PAGE, rng):
                file.seek(page * PAGE)
                file.write(rng.randbytes(PAGE))
    return damage


def assert_counted_misses(stats: dict[str, Any], stderr: str, path: Path) -> None:
    assert stats["wrong"] == 0, stats
    assert stats["errors"] > 0, stats
    # logged once (per operation), not once per item, and it says what to do
    said = stderr.count("delete the directory")
    assert 1 <= said <= 4, stderr[-3000:]
    assert str(path) in stderr


# -- damaged before the process opens it ------------------------------------------------------
@pytest.mark.parametrize("length", [
    pytest.param(lambda size: 100, id="100B"),
    pytest.param(lambda size: PAGE, id="1-page"),
    pytest.param(lambda size: 2 * PAGE - 100, id="under-2-pages"),
    pytest.param(lambda size: 2 * PAGE, id="2-pages"),
    pytest.param(lambda size: 10 * PAGE, id="10-pages"),
    pytest.param(lambda size: size // 2, id="half"),
    pytest.param(lambda size: size - 64 * PAGE, id="last-64-pages"),
    pytest.param(lambda size: size - 100, id="last-page-cut"),
])
def test_truncated_file_is_counted_misses(pristine: Path, tmp_path: Path,
                                          length: Callable[[int], int]) -> None:
    path = damaged(pristine, tmp_path, truncate_to(length))
    stats, stderr = read(path)
    assert_counted_misses(stats, stderr, path)
    assert stats["hits"] == 0


def test_file_truncated_to_nothing_is_an_empty_cache(pristine: Path, tmp_path: Path) -> None:
    """LMDB makes an empty data.mdb a new environment: misses, nothing to report, and a
    cache that works (values written back are read again)."""
    path = damaged(pristine, tmp_path, truncate_to(lambda size: 0))
    stats, _stderr = read(path)
    assert stats["wrong"] == 0 and stats["errors"] == 0 and stats["hits"] > 0


@pytest.mark.parametrize("pages", [[0], [1], [0, 1]], ids=["meta-0", "meta-1", "both"])
def test_overwritten_meta_pages_are_counted_misses(pristine: Path, tmp_path: Path,
                                                   pages: list[int]) -> None:
    path = damaged(pristine, tmp_path, overwrite_pages(lambda n, rng: pages))
    stats, stderr = read(path)
    assert_counted_misses(stats, stderr, path)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tenth_of_the_pages_overwritten_is_counted_misses(pristine: Path, tmp_path: Path,
                                                            seed: int) -> None:
    path = damaged(pristine, tmp_path, overwrite_pages(
        lambda n, rng: rng.sample(range(n), n // 10), seed))
    stats, stderr = read(path)
    assert_counted_misses(stats, stderr, path)


# -- damaged while the process has it open ----------------------------------------------------
def test_file_cut_while_open_is_counted_misses(pristine: Path, tmp_path: Path) -> None:
    path = damaged(pristine, tmp_path, lambda data: None)
    stats, stderr = read(path, "while-open")
    assert stats["hits_before"] >= len(SIZES)  # it was read healthy, then cut
    assert_counted_misses(stats, stderr, path)


# -- on_error="raise", and the error itself ---------------------------------------------------
def test_raise_mode_raises_a_store_error_naming_the_directory(pristine: Path,
                                                              tmp_path: Path) -> None:
    path = damaged(pristine, tmp_path, truncate_to(lambda size: size // 2))
    result, _stderr = read(path, "raise")
    assert result["raised"] == "EnvironmentDamaged", result
    assert "truncated" in result["message"] and f"delete the directory {path}" in result[
        "message"]


def test_damage_is_a_store_unavailable_and_final_for_the_process(pristine: Path,
                                                                 tmp_path: Path) -> None:
    """Safe in this process: only the meta pages are damaged, which is checked before
    LMDB touches anything."""
    path = damaged(pristine, tmp_path, overwrite_pages(lambda n, rng: [0, 1]))
    client = LmdbClient(path=str(path))

    async def main() -> None:
        for _ in range(2):
            with pytest.raises(ac.StoreUnavailable, match="meta page 0 was overwritten"):
                client.read_now([b"ac:damage:0"])
        with pytest.raises(ac.StoreUnavailable, match="delete the directory"):
            await client.set_many({b"k": b"v"})
        with pytest.raises(ac.StoreUnavailable, match="delete the directory"):
            await client.contains_many([b"k"])
        await client.close()

    asyncio.run(main())


# -- damage inside the B-tree that LMDB reads in C: found by the verifier at open ----------
def leaf_pages(data: Path) -> list[int]:
    raw = data.read_bytes()
    return [page for page in range(2, len(raw) // PAGE)
            if struct.unpack_from("<H", raw, page * PAGE + 10)[0] == 0x02]


def damage_overflow_sizes(data: Path) -> None:
    """Flip a high bit of the data size of every value kept in overflow pages, in the
    leaf nodes that hold them (LMDB 0.9: 16-byte page header, 2-byte node offsets; a
    node is lo, hi (the size), flags (1: F_BIGDATA), key size)."""
    raw = bytearray(data.read_bytes())
    for page in leaf_pages(data):
        at = page * PAGE
        lower = struct.unpack_from("<H", raw, at + 12)[0]
        for slot in range((lower - 16) // 2):
            node = at + struct.unpack_from("<H", raw, at + 16 + 2 * slot)[0]
            if struct.unpack_from("<H", raw, node + 4)[0] & 1:
                raw[node + 3] ^= 0x40  # + 1 GiB
    data.write_bytes(bytes(raw))


def damage_node_offsets(seed: int) -> Callable[[Path], None]:
    """Garbage over the node offsets of one leaf page, its header kept (so LMDB's page
    checks pass and it follows the offsets): before the verifier, 15 of 30 seeds were a
    SIGBUS in ``txn.get``."""
    def damage(data: Path) -> None:
        rng = random.Random(seed)
        page = rng.choice(leaf_pages(data))
        raw = bytearray(data.read_bytes())
        at = page * PAGE
        lower = struct.unpack_from("<H", raw, at + 12)[0]
        raw[at + 16:at + lower] = rng.randbytes(lower - 16)
        data.write_bytes(bytes(raw))
    return damage


def test_damaged_size_of_an_overflow_value_is_counted_misses(pristine: Path,
                                                             tmp_path: Path) -> None:
    """py-lmdb's get touches every page of a value in C, and neither LMDB nor py-lmdb
    checks an overflow value's size against its pages: without the verifier, SIGBUS."""
    path = damaged(pristine, tmp_path, damage_overflow_sizes)
    stats, stderr = read(path)
    assert_counted_misses(stats, stderr, path)
    assert "overflow" in stderr


@pytest.mark.parametrize("seed", range(12))
def test_garbage_node_offsets_in_a_leaf_page_are_counted_misses(pristine: Path,
                                                                tmp_path: Path,
                                                                seed: int) -> None:
    path = damaged(pristine, tmp_path, damage_node_offsets(seed))
    stats, stderr = read(path)
    assert_counted_misses(stats, stderr, path)
    assert stats["hits"] == 0  # damage found at open: the environment is not read


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
