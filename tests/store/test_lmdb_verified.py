"""Verify-then-trust for LMDB (store/lmdb/verified.py): a file is walked when a process
opens it in a state not walked before (any commit makes a new state), a state walked
once is trusted without a walk, and a walk never reports damage because another
process commits while it runs."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import asynccache as ac
from asynccache.store.lmdb import verified
from asynccache.store.lmdb.damage import Env
from asynccache.store.lmdb.package import lmdb

SRC = Path(__file__).resolve().parents[2] / "src"

#: opens ``lmdb://<path>?<query>``, writes ``count`` values or reads them; the verifier's
#: log lines (DEBUG) go to stderr
CHILD = textwrap.dedent("""
    import asyncio, logging, sys
    import asynccache as ac
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    logging.getLogger("asynccache").setLevel(logging.DEBUG)
    path, query, action, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    async def main():
        client = ac.connect(f"lmdb://{path}?{query}")
        keys = [b"k%d" % i for i in range(count)]
        if action == "write":
            await client.set_many({key: key * 50 for key in keys})
        else:
            values = await client.get_many(keys)
            assert values == [key * 50 for key in keys], "wrong or missing values"
        await client.close()
    try:
        asyncio.run(main())
    except ac.StoreError as exc:
        print(type(exc).__name__, exc)
""")


def run(path: Path, action: str, count: int = 200, query: str = "") -> str:
    """The child's stdout and stderr together (it exits 0 unless it crashed)."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), query, action, str(count)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def walked(output: str, path: Path) -> bool:
    return f"verified {path}/data.mdb" in output


def test_a_state_walked_once_is_not_walked_again(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    assert walked(run(path, "write"), path)  # a new, empty environment: walked at once
    out = run(path, "read")
    assert walked(out, path), out  # the write changed the file: walked again
    record = verified.recorded(str(path))
    assert record is not None and record.txnid >= 1
    out = run(path, "read")
    assert not walked(out, path), out  # unchanged since: trusted
    out = run(path, "write", 400)
    assert not walked(out, path), out  # opened unchanged, then written
    assert walked(run(path, "read", 400), path)
    assert not walked(run(path, "read", 400), path)


def test_a_change_by_another_program_is_walked_and_found(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    run(path, "write", 2000)
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    page = 4096 * 3  # a leaf page: garbage over its node offsets, header kept
    assert raw[page + 10] == 0x02
    raw[page + 16:page + 64] = random.Random(0).randbytes(48)
    with data.open("r+b") as file:  # in place: same inode, new mtime
        file.write(raw)
    out = run(path, "read", 2000)
    assert walked(out, path) is False  # the walk failed: no "verified" line
    assert "EnvironmentDamaged" in out and "the check at open found" in out, out


def test_verify_false_neither_walks_nor_records(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    out = run(path, "write", query="verify=false")
    assert not walked(out, path) and verified.recorded(str(path)) is None
    with pytest.raises(ac.InvalidURL, match="verify"):
        ac.connect(f"lmdb://{path}?verify=perhaps")


def test_a_walk_beside_a_writer_in_another_process_finds_nothing(tmp_path: Path) -> None:
    """The writer overwrites and deletes (pages freed and reused) while this process
    walks the file again and again, its record removed each time: the read
    transaction `verified.problems` holds keeps every page the walk reaches in place."""
    path = tmp_path / "cache"
    run(path, "write", 3000)
    writer = textwrap.dedent("""
        import os, random, sys, lmdb
        env = lmdb.open(sys.argv[1], map_size=1 << 30)
        rng = random.Random(1)
        for n in range(1500):
            with env.begin(write=True) as txn:
                for _ in range(40):
                    key = b"k%d" % rng.randrange(3000)
                    if rng.random() < 0.3:
                        txn.delete(key)
                    else:
                        txn.put(key, os.urandom(rng.choice([50, 900, 5000])))
        env.close()
    """)
    child = subprocess.Popen([sys.executable, "-c", writer, str(path)])
    env = lmdb.open(str(path), map_size=1 << 30)
    held = Env(env, str(path), "test")
    walks = 0
    try:
        while child.poll() is None:
            with open(os.path.join(path, verified.RECORD), "w") as stale:
                stale.write("{}")  # not a state: walk
            assert verified.problem(env, str(path), held.fd, held.psize) is None
            walks += 1
    finally:
        child.wait(timeout=120)
        held.close()
    assert child.returncode == 0
    assert walks >= 5, walks  # the writer was busy for a while: the walks overlapped it


def test_the_record_is_written_whole(tmp_path: Path) -> None:
    """Renamed into place; an unreadable record is no record (the next open walks)."""
    state = verified.Identity(1, 2, 3, 4, 5)
    verified.record(str(tmp_path), state)
    assert verified.recorded(str(tmp_path)) == state
    assert [p.name for p in tmp_path.iterdir()] == [verified.RECORD]
    (tmp_path / verified.RECORD).write_text('{"device": 1')
    assert verified.recorded(str(tmp_path)) is None


def test_two_processes_opening_at_once_both_read_right(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    run(path, "write", 2000, query="sync=false")  # not trusted: both opens walk
    outs: list[str] = []
    threads = [threading.Thread(target=lambda: outs.append(run(path, "read", 2000)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outs) == 2 and not any("Error" in out for out in outs), outs
