"""Files on shared local storage (the stats boards in /dev/shm) are the user's own: a
directory another user planted, linked or loosened is never used, never chmod-ed, never
swept through; a board that does not parse is ignored; every process that makes a board
removes it when it exits, forked children included.

The shared directory is a private stand-in for /dev/shm (mode 1777, through
``ASYNCCACHE_STATS_DIR``), so these tests never disturb the boards of other test runs.
The other user is ``nobody`` (uid 65534), reached with ``setuid`` in a child: root only.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import multiprocessing
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torchdata.nodes import SamplerWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

import asynccache as ac
from asynccache.nodes import CachedMapper, NodeIterable
from asynccache.observe import board as board_module
from asynccache.observe.board import ENV_DIR, META_FILE, StatsBoard, boards_root
from asynccache.observe.counts_file import CountsFile
from asynccache.testing import servers

OTHER_UID = 65534  # nobody
N = 40
OLD = time.time() - 3 * 24 * 3600  # "three days ago": older than the sweep's day


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("a second local user is needed: run as root to setuid to nobody")


def as_other_user(script: str) -> None:
    """Run ``script`` (sh) as another local user; it must succeed."""
    def become() -> None:
        os.setgroups([])
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)

    done = subprocess.run(["/bin/sh", "-c", script], preexec_fn=become, capture_output=True,
                          text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh shared directory like /dev/shm (everyone may create, sticky)."""
    path = Path(tempfile.mkdtemp(prefix="asynccache-shm-", dir="/tmp"))
    path.chmod(0o1777)
    monkeypatch.setenv(ENV_DIR, str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victim_files() -> Iterator[Path]:
    """Files of the victim, three days old, that nothing of asynccache may touch."""
    home = Path(tempfile.mkdtemp(prefix="asynccache-victim-", dir="/tmp"))
    (home / "thesis").mkdir()
    (home / "thesis" / "chapter1.tex").write_text("\\chapter{One}")
    board_like = home / "0123456789abcdef"  # shaped like a board, a label and all
    board_like.mkdir()
    (board_like / META_FILE).write_text(json.dumps({"namespace": "x", "owner": 999999}))
    for p in (home / "thesis" / "chapter1.tex", home / "thesis", board_like / META_FILE,
              board_like):
        os.utime(p, (OLD, OLD))
    home.chmod(0o755)
    yield home
    shutil.rmtree(home, ignore_errors=True)


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def pipe(namespace: str | None = None) -> ac.AsyncKVCacheMapDataPipe:
    """A pipe over a store of its own (every read of a fresh pipe misses)."""
    return ac.AsyncKVCacheMapDataPipe(list(range(N)), ac.connect("memory://boards"),
                                      namespace=namespace or secrets.token_hex(8))


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and text in r.getMessage()]


# -- a directory that is not the user's own is never used ------------------------------------
def test_a_symlink_planted_by_another_user_is_never_followed(
        shared: Path, victim_files: Path, caplog: pytest.LogCaptureFixture) -> None:
    needs_root()
    root = boards_root()
    as_other_user(f"ln -s {victim_files} {root}")
    before = tree(victim_files)
    caplog.set_level(logging.WARNING, logger="asynccache")
    dp = pipe()  # building a pipe sweeps old boards: never through the link
    assert [dp[i] for i in range(N)] == list(range(N))
    stats = dp.stats()
    dp.close()
    del dp
    assert stats["misses"] == N
    assert tree(victim_files) == before  # nothing deleted, nothing written
    assert (victim_files / "thesis" / "chapter1.tex").read_text() == "\\chapter{One}"
    assert root.is_symlink()  # and not "fixed" either
    (warning,) = warnings_of(caplog, "stats boards are off")
    assert "symbolic link" in warning and str(root) in warning


@pytest.mark.parametrize("planted", ["other-owner-0777", "other-owner-0755", "own-0777"])
def test_a_directory_not_the_users_own_is_refused_and_left_as_it_is(
        shared: Path, planted: str, caplog: pytest.LogCaptureFixture) -> None:
    """Another user's directory (open to all, or not) and a directory of ours that others
    may write are never used: nothing is read from it (a planted board with non-int
    counters, planted log-once markers), nothing written into it, its mode unchanged; the
    store failure is still logged, once."""
    root = boards_root()
    mode = 0o777 if planted.endswith("0777") else 0o755
    if planted.startswith("other"):
        needs_root()
        as_other_user(
            f"mkdir -m {mode:o} {root} && cd {root} && for b in 0123456789abcdef x; do "
            f"mkdir -m 777 $b $b/logged && echo '{{\"hits\": \"many\"}}' > $b/4242.json && "
            f"touch $b/logged/get-StoreUnavailable $b/logged/get-StoreTimeout; done")
    else:
        root.mkdir()
        root.chmod(mode)
    before = tree(root)
    caplog.set_level(logging.WARNING, logger="asynccache")
    dead = ac.connect(f"redis://127.0.0.1:{servers.free_port()}/0", timeout=0.3,
                      connect_timeout=0.3)  # nobody listens there
    dp = ac.AsyncKVCacheMapDataPipe(list(range(N)), dead, namespace="refused")
    assert [dp[i] for i in range(N)] == list(range(N))
    stats = dp.stats()  # planted boards are not this pipe's: never read, never raised
    dp.close()
    assert stats["misses"] == N and stats["errors"] >= 1
    assert tree(root) == before
    assert root.stat().st_mode & 0o777 == mode  # never chmod-ed
    (off,) = warnings_of(caplog, "stats boards are off")
    assert ("belongs to uid 65534" if planted.startswith("other") else "writable") in off
    assert len(warnings_of(caplog, "get failed")) == 1  # markers were not consulted


def test_a_directory_of_ours_that_others_may_read_is_closed_to_0700(shared: Path) -> None:
    root = boards_root()
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # as an older release made it under umask 022
    dp = pipe()
    assert [dp[i] for i in range(N)] == list(range(N))
    assert dp._reports.board.exists()  # in use: not refused
    assert root.stat().st_mode & 0o777 == 0o700
    dp.close()


def test_a_board_file_that_does_not_parse_is_ignored_and_counted(shared: Path) -> None:
    dp = pipe()
    dp.__getitems__(list(range(N)))
    board = dp._reports.board
    directory = boards_root() / board.board_id
    (directory / "4242.counts").write_bytes(b"\0" * 16 + b'["hits"]')  # names, no values
    (directory / "4243.counts").write_bytes(b"{not counters")
    (directory / "4244.counts").write_bytes(b"\1" + b"\0" * 100)  # a write never ended
    fd = os.open(directory / "4245.counts", os.O_RDWR | os.O_CREAT, 0o600)
    CountsFile(fd).write({"hits": 7, "misses": 1})  # a worker's
    os.close(fd)
    (directory / "latency").mkdir(exist_ok=True)
    (directory / "latency" / "4242.json").write_text(json.dumps({"read": ["x"]}))
    stats = dp.stats()
    assert stats["hits"] == 7 and stats["misses"] == N + 1
    assert board.errors == 3
    dp.latency()  # the bad histogram is skipped too
    assert board.errors == 4
    dp.close()


def test_log_once_markers_live_only_in_a_verified_directory(shared: Path) -> None:
    board = StatsBoard("0123456789abcdef")
    board.label("markers")
    assert board.claim("get-StoreTimeout") and not board.claim("get-StoreTimeout")
    board.remove()
    boards_root().chmod(0o777)  # now others could plant markers: none is trusted
    fresh = StatsBoard("fedcba9876543210")
    fresh.label("markers")
    assert fresh.claim("get-StoreTimeout") and fresh.claim("get-StoreTimeout")
    assert not (boards_root() / "fedcba9876543210").exists()


# -- the sweep deletes only what it can prove it made ----------------------------------------
def test_the_sweep_never_follows_a_link_and_deletes_only_old_boards_of_dead_owners(
        shared: Path, victim_files: Path) -> None:
    root = boards_root()
    StatsBoard("aaaaaaaaaaaaaaaa").label("old")  # makes the verified root
    StatsBoard("bbbbbbbbbbbbbbbb").label("alive")
    dead = _dead_pid()
    for name, owner in (("aaaaaaaaaaaaaaaa", dead), ("bbbbbbbbbbbbbbbb", os.getpid())):
        (root / name / META_FILE).write_text(json.dumps({"namespace": "x", "owner": owner}))
    (root / "aaaaaaaaaaaaaaaa" / "link").symlink_to(victim_files / "thesis")
    (root / "cccccccccccccccc").symlink_to(victim_files)  # a link shaped like a board
    (root / "notaboard").mkdir()  # not a board's name
    (root / "dddddddddddddddd").mkdir()  # no label: not provably a board
    for name in ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "notaboard", "dddddddddddddddd"):
        os.utime(root / name, (OLD, OLD))
    os.utime(root / "cccccccccccccccc", (OLD, OLD), follow_symlinks=False)
    before = tree(victim_files)
    dp = pipe()  # sweeps
    dp.close()
    left = sorted(p.name for p in root.iterdir())
    assert "aaaaaaaaaaaaaaaa" not in left  # old, its owner gone: swept
    assert {"bbbbbbbbbbbbbbbb", "cccccccccccccccc", "notaboard", "dddddddddddddddd"} <= set(left)
    assert tree(victim_files) == before  # the link inside was removed, not followed


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# -- every process that makes a board removes it when it exits ------------------------------
def _use_a_pipe(_: object = None) -> int:
    dp = pipe(f"child-{os.getpid()}")
    assert [dp[i] for i in range(N)] == list(range(N))
    assert dp._reports.board.exists()
    return os.getpid()


def boards() -> list[str]:
    root = boards_root()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_boards_of_forked_process_children_are_removed_when_they_exit(shared: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_use_a_pipe) for _ in range(4)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [c.exitcode for c in children] == [0] * 4
    assert boards() == []


def test_boards_of_forked_pool_workers_are_removed_when_they_exit(shared: Path) -> None:
    with multiprocessing.get_context("fork").Pool(3) as pool:
        pids = pool.map(_use_a_pipe, range(6))
        pool.close()
        pool.join()
    assert len(pids) == 6
    assert boards() == []


class _Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index


class _Shard(torch.utils.data.Sampler[int]):
    def __init__(self, items: list[int]) -> None:
        self.items = items

    def __iter__(self) -> Any:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def _worker_node(worker: int, workers: int) -> CachedMapper[Any]:
    shard = list(range(N))[worker::workers]
    return CachedMapper(SamplerWrapper(_Shard(shard)), _Items().__getitem__,
                        ac.connect("memory://nodes"), namespace="nodes", prefetch=8)


def test_boards_of_nodes_built_in_stateful_dataloader_workers_are_removed(
        shared: Path) -> None:
    loader = StatefulDataLoader(NodeIterable(_worker_node), batch_size=8, num_workers=2,
                                collate_fn=lambda b: b, multiprocessing_context="fork")
    got = sorted(i for batch in loader for i in batch)
    assert got == list(range(N))
    del loader
    deadline = time.monotonic() + 30  # the workers exit when the iterator is let go of
    while boards() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert boards() == []


def test_a_late_report_of_a_copy_does_not_bring_a_removed_board_back(shared: Path) -> None:
    dp = pipe()
    board = dp._reports.board
    assert board.exists()
    board.remove()
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_read_in_child, args=(dp,))  # a copy: publishes, closes
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert boards() == []
    dp.close()


def test_a_board_removed_after_a_copy_kept_its_directory_open_stays_removed(
        shared: Path) -> None:
    """A copy that reports with its batches keeps its counts file open; once the owner
    removed the board, such a report writes nowhere, makes nothing."""
    from asynccache.observe.board import StatsBoard

    board = StatsBoard(secrets.token_hex(8))
    board.label("ns")
    copy = StatsBoard(board.board_id)
    copy.publish({"hits": 1})
    assert (board.directory / f"{os.getpid()}.counts").is_file()
    board.remove()
    with contextlib.suppress(OSError):
        copy.publish({"hits": 2})
    assert not board.directory.exists()
    assert boards() == []


def _read_in_child(dp: ac.AsyncKVCacheMapDataPipe) -> None:
    assert [dp[i] for i in range(N)] == list(range(N))
    dp.close()  # publishes its final numbers: into a board that is gone, so nowhere


def test_the_owner_removes_its_board_when_it_lets_go_of_the_pipe(shared: Path) -> None:
    dp = pipe()
    name = dp._reports.board.board_id
    assert boards() == [name]
    assert (boards_root().stat().st_mode & 0o777) == 0o700
    del dp
    gc.collect()
    assert boards() == []
    assert name not in board_module._owned
