"""The counts file a DataLoader worker rewrites with every batch: a reader in another
process never sees half a write (asynccache.observe.counts_file)."""

from __future__ import annotations

import multiprocessing
import os
import struct
from pathlib import Path

from asynccache.observe.counts_file import CountsFile, read

LIMIT = 1 << 20


def open_file(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


def test_counters_read_back_as_written_when_names_come_and_go(tmp_path: Path) -> None:
    fd = open_file(tmp_path / "1.counts")
    counts = CountsFile(fd)
    counts.write({"hits": 1, "misses": 2})
    assert read(fd, LIMIT) == {"hits": 1, "misses": 2}
    counts.write({"hits": 5, "misses": 2, "a_counter_an_integration_added": 9})
    assert read(fd, LIMIT) == {"hits": 5, "misses": 2, "a_counter_an_integration_added": 9}
    counts.write({"hits": 6})  # fewer names: what the longer list left behind is not read
    assert read(fd, LIMIT) == {"hits": 6}
    counts.write({"hits": 1 << 70, "misses": -(1 << 70)})  # beyond int64: the bounds
    assert read(fd, LIMIT) == {"hits": (1 << 63) - 1, "misses": -(1 << 63)}
    os.close(fd)


def test_a_file_that_is_not_counters_reads_as_none(tmp_path: Path) -> None:
    fd = open_file(tmp_path / "2.counts")
    assert read(fd, LIMIT) is None  # empty: the writer has just made it
    CountsFile(fd).write({"hits": 3})
    assert read(fd, 10) is None  # a record larger than the limit
    header = os.pread(fd, 32, 0)
    os.pwrite(fd, bytes([header[0] ^ 0x10]) + header[1:], 0)  # its check word fails
    assert read(fd, LIMIT) is None
    os.pwrite(fd, header, 0)
    _, offset, length, _ = struct.unpack("<QQQQ", header)
    os.pwrite(fd, b"\0" * length, offset)  # the record it points to is not one
    assert read(fd, LIMIT) is None
    os.close(fd)


def test_a_writer_stopped_mid_write_leaves_its_last_whole_record(tmp_path: Path) -> None:
    """What a reader finds while a writer's thread is held between its two writes (another
    thread has the GIL), or after it died there: the previous record, never a wait."""
    fd = open_file(tmp_path / "3.counts")
    counts = CountsFile(fd)
    counts.write({"hits": 3, "misses": 4})
    counts.write({"hits": 5, "misses": 6})
    _, offset, _, _ = struct.unpack("<QQQQ", os.pread(fd, 32, 0))
    other = 32 if offset != 32 else 32 + 4096
    os.pwrite(fd, b"\xff" * 200, other)  # the next record, half written
    assert read(fd, LIMIT) == {"hits": 5, "misses": 6}
    os.close(fd)


def test_many_counters_move_the_regions(tmp_path: Path) -> None:
    fd = open_file(tmp_path / "4.counts")
    counts = CountsFile(fd)
    for n in (3, 400, 5, 2_000, 7):
        want = {f"a_counter_with_a_long_name_{k}": k * n for k in range(n)}
        counts.write(want)
        assert read(fd, LIMIT) == want
    os.close(fd)


def width(i: int) -> int:
    return (3, 4, 300, 5)[(i // 500) % 4]


def _write_fast(path: str, rounds: int) -> None:
    fd = os.open(path, os.O_RDWR)
    counts = CountsFile(fd)
    for i in range(1, rounds + 1):
        names = width(i)  # now and then other names: regions move, records shrink
        counts.write({f"c{k}": i for k in range(names)})
    os.close(fd)


def test_a_reader_in_another_process_sees_whole_writes_only(tmp_path: Path) -> None:
    path = tmp_path / "5.counts"
    fd = open_file(path)
    CountsFile(fd).write({"c0": 0})
    rounds = 20_000
    child = multiprocessing.get_context("fork").Process(target=_write_fast,
                                                        args=(str(path), rounds))
    child.start()
    seen, last = 0, 0
    while child.is_alive() or seen == 0:
        found = read(fd, LIMIT)
        if found is None:  # rewritten during each of many reads: this writer never
            continue  # pauses; a worker writes once a batch
        values = set(found.values())
        assert len(values) == 1, found  # every counter of one write, nothing mixed
        (value,) = values
        assert value >= last, (value, last)
        if value:
            assert len(found) == width(value), found
        last, seen = value, seen + 1
    child.join(60)
    assert child.exitcode == 0
    assert read(fd, LIMIT) == {f"c{k}": rounds for k in range(width(rounds))}
    assert seen > 10
    os.close(fd)
