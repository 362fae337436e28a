"""One process's counters in a small file another process reads at any moment.

A DataLoader worker reports its counters with every batch it hands over, so that the
training loop's ``dp.stats()`` counts every read of the batches it has received. A report
must then cost a few microseconds, not the ~40 µs of writing a JSON file and renaming it
into place. So each process keeps one file open and writes its numbers in place, in two
alternating regions behind a header:

    header (32 bytes)  sequence, offset and length of the current record, a check word
    record             number of counters, length of the names, the counters (int64
                       little-endian), the names (a JSON list of str)

A write goes to the region the header does not point to, then the header is rewritten to
point to it (two ``pwrite`` calls, two system calls: another process sees them in that
order on any CPU). A reader reads the header, the record it points to, the header again,
and keeps the record only when both headers are the same (and their check word holds, so a
header read while it was being written is never taken for one). The record it read cannot
have been written meanwhile: the writer only writes the region the header does not point
to, and pointing the header away from it changes the sequence. So a writer held up in the
middle of a write (another thread has the GIL for milliseconds) never holds a reader up,
and a writer that dies mid-write leaves its last whole record readable.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable

__all__ = ["CountsFile", "parse", "read"]

_HEADER = struct.Struct("<QQQQ")  # sequence, offset, length, check
_RECORD = struct.Struct("<II")  # counters, length of the names
_MAGIC = 0x61_63_63_6F_75_6E_74_73  # "accounts": a check word that is never all zeros
#: How often a reader tries again when a write ended while it read (a worker writes
#: once a batch: one retry is rare, two rarer).
_TRIES = 64
_INT64 = (-(1 << 63), (1 << 63) - 1)
#: The first regions' size: ~40 counters take ~1.2 KiB; larger records move the regions.
_REGION = 4096


def _header(sequence: int, offset: int, length: int) -> bytes:
    return _HEADER.pack(sequence, offset, length, sequence ^ offset ^ length ^ _MAGIC)


class CountsFile:
    """The writing side: one open file of this process (see the module's docstring)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.sequence = 0
        self._regions = (_HEADER.size, _HEADER.size + _REGION)
        self._size = _REGION
        self._names: tuple[str, ...] | None = None
        self._encoded = b""
        self._values: struct.Struct | None = None

    def write(self, counters: dict[str, int]) -> None:
        """Replace the counters in the file (a reader never sees half of them)."""
        names = tuple(counters)
        if names != self._names or self._values is None:
            self._encoded = json.dumps(names).encode()
            self._values = struct.Struct(f"<II{len(names)}q")
            self._names = names
        record = _packed(self._values, len(names), len(self._encoded),
                         counters.values()) + self._encoded
        if len(record) > self._size:  # two larger regions after the current end
            end = self._regions[1] + self._size
            self._size = 2 * len(record)
            self._regions = (end, end + self._size)
        sequence = self.sequence + 1
        offset = self._regions[sequence % 2]
        os.pwrite(self.fd, record, offset)
        os.pwrite(self.fd, _header(sequence, offset, len(record)), 0)
        self.sequence = sequence


def _packed(layout: struct.Struct, count: int, names_len: int,
            values: Iterable[int]) -> bytes:
    try:
        return layout.pack(count, names_len, *values)
    except struct.error:  # a counter beyond int64 (never in practice): the nearest bound
        return layout.pack(count, names_len,
                           *(min(max(v, _INT64[0]), _INT64[1]) for v in values))


def read(fd: int, limit: int) -> dict[str, int] | None:
    """The counters in the open file ``fd`` (a record of at most ``limit`` bytes), or None
    when it does not hold counters (or was rewritten during each of several reads)."""
    for _ in range(_TRIES):
        before = os.pread(fd, _HEADER.size, 0)
        if len(before) != _HEADER.size:
            return None  # empty: its writer has just made it
        sequence, offset, length, check = _HEADER.unpack(before)
        if check != sequence ^ offset ^ length ^ _MAGIC:
            continue  # read while it was being written
        if length > limit:
            return None
        record = os.pread(fd, length, offset)
        if os.pread(fd, _HEADER.size, 0) == before:
            return parse(record)
    return None


def parse(record: bytes) -> dict[str, int] | None:
    """The counters of a record, or None when it is not one."""
    if len(record) < _RECORD.size:
        return None
    count, names_len = _RECORD.unpack_from(record)
    end = _RECORD.size + 8 * count
    if len(record) != end + names_len:
        return None
    try:
        names = json.loads(record[end:])
    except ValueError:
        return None
    if not isinstance(names, list) or len(names) != count \
            or not all(isinstance(n, str) for n in names):
        return None
    return dict(zip(names, struct.unpack_from(f"<{count}q", record, _RECORD.size)))
