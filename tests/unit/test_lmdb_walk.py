"""The walk at open (store/lmdb/walk.py) over real LMDB files damaged byte by byte: each
kind of damage LMDB would follow in C is named, and every state LMDB itself writes
passes (no false alarm makes a healthy cache unusable)."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from asynccache.store.lmdb import layout
from asynccache.store.lmdb.package import lmdb
from asynccache.store.lmdb.verified import _walk_committed

PSIZE = 4096


def committed(path: Path) -> layout.Meta:
    raw = (path / "data.mdb").read_bytes()
    metas = [layout.parse_meta(raw[page * PSIZE:page * PSIZE + layout.META.size])
             for page in (0, 1)]
    return max(metas, key=lambda meta: meta.txnid)


def found(path: Path) -> str | None:
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        return _walk_committed(fd, PSIZE)
    finally:
        os.close(fd)


@pytest.fixture
def env_path(tmp_path: Path) -> Iterator[Path]:
    """Small values in leaf pages, large ones in overflow runs, a few deleted (so the
    free-page tree holds lists), several levels of branch pages."""
    env = lmdb.open(str(tmp_path), map_size=1 << 28)
    with env.begin(write=True) as txn:
        for i in range(4000):
            txn.put(b"key-%05d" % i, bytes([i % 251]) * (9000 if i % 100 == 0 else 60))
    for start in range(0, 400, 40):
        with env.begin(write=True) as txn:
            for i in range(start, start + 20):
                txn.delete(b"key-%05d" % i)
    env.close()
    yield tmp_path


def patch(path: Path, offset: int, data: bytes) -> None:
    with (path / "data.mdb").open("r+b") as file:
        file.seek(offset)
        file.write(data)


def pages_of(path: Path, flags: int) -> list[int]:
    raw = (path / "data.mdb").read_bytes()
    return [page for page in range(2, committed(path).last + 1)
            if layout.PAGE.unpack_from(raw, page * PSIZE)[1] & 0x07 == flags]


def nodes(path: Path, page: int) -> list[int]:
    raw = (path / "data.mdb").read_bytes()
    lower = layout.PAGE.unpack_from(raw, page * PSIZE)[2]
    count = (lower - layout.PAGE_HEADER) // 2
    return list(struct.unpack_from(f"<{count}H", raw, page * PSIZE + layout.PAGE_HEADER))


def main_leaf(path: Path, which: int = 0) -> int:
    """A leaf page of the main tree: down from the root by the ``which``-th node."""
    raw = (path / "data.mdb").read_bytes()
    page = committed(path).main_root
    while layout.PAGE.unpack_from(raw, page * PSIZE)[1] & layout.P_BRANCH:
        lo, hi, flags, _ = layout.NODE.unpack_from(raw, page * PSIZE + nodes(path, page)[which])
        page = lo | hi << 16 | flags << 32
    return page


def test_a_healthy_file_passes(env_path: Path) -> None:
    meta = committed(env_path)
    assert meta.main_depth >= 2 and meta.free_root != layout.P_INVALID
    assert found(env_path) is None


def test_a_longer_run_than_the_value_needs_passes(tmp_path: Path) -> None:
    """LMDB overwrites a value in overflow pages in place with a shorter one when the
    pages are its own in this transaction, keeping the longer run's page count."""
    env = lmdb.open(str(tmp_path), map_size=1 << 28)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"x" * 20000)
        txn.put(b"k", b"y" * 5000)
    env.close()
    assert found(tmp_path) is None


def test_node_offsets_outside_the_page_are_found(env_path: Path) -> None:
    leaf = main_leaf(env_path)
    patch(env_path, leaf * PSIZE + layout.PAGE_HEADER, struct.pack("<H", PSIZE - 4))
    assert "outside the page" in (found(env_path) or "")


def test_a_value_running_past_its_page_is_found(env_path: Path) -> None:
    leaf = main_leaf(env_path, -1)
    node = nodes(env_path, leaf)[0]
    patch(env_path, leaf * PSIZE + node, struct.pack("<HH", 0xFFFF, 0))  # size 65535
    assert "runs past the page" in (found(env_path) or "")


def test_a_damaged_overflow_value_size_is_found(env_path: Path) -> None:
    raw = (env_path / "data.mdb").read_bytes()
    for leaf in pages_of(env_path, layout.P_LEAF):
        for node in nodes(env_path, leaf):
            at = leaf * PSIZE + node
            if layout.NODE.unpack_from(raw, at)[2] & layout.F_BIGDATA:
                patch(env_path, at + 2, struct.pack("<H", 0x4000))  # + 1 GiB
                assert "past the last page in use" in (found(env_path) or "")
                return
    pytest.fail("no value in overflow pages")


def test_an_overflow_run_shorter_than_its_value_is_found(env_path: Path) -> None:
    run = pages_of(env_path, layout.P_OVERFLOW)[0]
    patch(env_path, run * PSIZE + 12, struct.pack("<I", 1))  # 9,000 bytes need 3
    assert "does not hold" in (found(env_path) or "")


def test_a_garbage_free_page_list_is_found(env_path: Path) -> None:
    meta = committed(env_path)
    root = meta.free_root
    assert meta.free_depth == 1  # the free-page tree is one leaf here
    node = nodes(env_path, root)[0]
    key_size = layout.NODE.unpack_from((env_path / "data.mdb").read_bytes(),
                                       root * PSIZE + node)[3]
    patch(env_path, root * PSIZE + node + layout.NODE_HEADER + key_size,
          struct.pack("<Q", 1 << 40))  # the list's count
    assert "free-page list" in (found(env_path) or "")


def test_a_page_reached_twice_is_found(env_path: Path) -> None:
    """A loop in the tree (a branch node pointing at a page already reached)."""
    branch = committed(env_path).main_root
    first, second = nodes(env_path, branch)[:2]
    raw = (env_path / "data.mdb").read_bytes()
    patch(env_path, branch * PSIZE + second,
          raw[branch * PSIZE + first:branch * PSIZE + first + 6])  # the same child
    assert "reached twice" in (found(env_path) or "")


def test_a_page_past_the_end_of_the_file_is_found(env_path: Path) -> None:
    data = env_path / "data.mdb"
    leaf = main_leaf(env_path, -1)
    os.truncate(data, leaf * PSIZE + 100)
    assert found(env_path) is not None
