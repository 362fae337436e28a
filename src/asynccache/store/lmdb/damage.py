"""What LMDB does not check: damaged files (truncated, overwritten) found before a batch
touches them, so that they are counted misses instead of a SIGBUS (docs/design.md, "LMDB")."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from typing import Any

from ...errors import CacheError, StoreUnavailable
from .package import lmdb

__all__ = ["DAMAGE", "Env", "EnvironmentDamaged", "damaged", "file_problem"]


class EnvironmentDamaged(StoreUnavailable):
    """The environment's files are damaged (truncated, overwritten): this process no
    longer reads or writes it, and the message names the directory to delete."""


#: lmdb errors that mean the files are damaged, not that an operation failed (MDB_PANIC
#: may follow a failed write, a full disk: a plain store error)
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError)

#: LMDB 0.9's meta page (mdb.c: a 16-byte page header, then MDB_meta), the fields read:
#: page number, page flags; magic, data version, map size; the free-page DB's md_pad (the
#: page size), flags, depth, root; the main DB's flags, depth, root; last page, txnid.
_META = struct.Struct("<Q2xH4xII8xQIHH32xQ4xHH32xQQQ")
_META_MAGIC = 0xBEEFC0DE
_META_VERSION = 1       # MDB_DATA_VERSION of LMDB 0.9
_P_META = 0x08
_P_INVALID = (1 << 64) - 1
_INTEGERKEY = 0x08      # the free-page DB's flags
_MAX_DEPTH = 32         # CURSOR_STACK
_KNOWN_FORMAT = lmdb.version()[:2] == (0, 9)


def damaged(where: str, path: str, reason: str) -> str:
    return (f"LMDB {where} is damaged: {reason}. asynccache no longer reads or writes it in "
            "this process (values are computed from the source); stop the jobs that use it "
            f"and delete the directory {path} (the cache is rebuilt as it is used)")


class Env:
    """An open environment, and the checks that keep its files from killing the process.

    LMDB maps data.mdb into memory and trusts it. It checks what it reads of the B-tree
    (page types and bounds, leaf values within their page, page numbers below the last
    page in use), but not that the file still holds those pages: touching one past the
    end of the file raises SIGBUS. So before each batch `check()` compares the
    file's size with what both meta pages say is in use and checks the meta pages
    themselves; damage, once seen (here or by LMDB), is final for this process.
    """

    def __init__(self, env: Any, path: str, where: str) -> None:
        self.env = env
        self.path = path
        self.where = where
        self.damage: str | None = None
        self.metas: mmap.mmap | None = None  # the two meta pages, mapped once checked
        #: the meta pages' first bytes as last checked, and the size they need
        self.verified: tuple[bytes, bytes, int] = (b"", b"", 1 << 62)
        self.fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            head = os.pread(self.fd, _META.size, 0)
            fields = _META.unpack(head) if len(head) == _META.size else None
        except OSError:
            fields = None
        # the meta pages are parsed only in the format known here; LMDB accepted this file
        # a moment ago, so a meta page that does not parse means another format
        self.parse = bool(_KNOWN_FORMAT and fields and fields[2] == _META_MAGIC
                          and fields[3] == _META_VERSION and _page_size(fields[5]))
        self.psize = fields[5] if self.parse and fields else mmap.PAGESIZE
        with contextlib.suppress(CacheError):
            self.check()  # damage found here is kept, and raised on first use

    def close(self) -> None:
        self.env.close()
        if self.metas is not None:
            self.metas.close()
        os.close(self.fd)

    def fail(self, reason: str) -> EnvironmentDamaged:
        """Damage: from now on every use of this environment in this process raises."""
        if self.damage is None:
            self.damage = damaged(self.where, self.path, reason)
        return EnvironmentDamaged(self.damage)

    def check(self) -> None:
        """Raise `EnvironmentDamaged` unless data.mdb holds every page in use and
        both meta pages are sane. Meta pages as already checked, in a file still long
        enough, cost one ``fstat`` and two 152-byte compares (~1.5 µs); a commit changes
        them, and they are checked again (~3.5 µs).

        A commit in flight can show a meta page half written, or one newer than the size
        read first: a failed check is repeated twice before it counts.
        """
        if self.damage is not None:
            raise EnvironmentDamaged(self.damage)
        try:
            size = os.fstat(self.fd).st_size
            meta0, meta1, needed = self.verified
            metas, psize = self.metas, self.psize
            if (size >= needed and metas is not None and metas[:_META.size] == meta0
                    and metas[psize:psize + _META.size] == meta1):
                return
            for attempt in range(3):
                if attempt:
                    time.sleep(0.001)
                    size = os.fstat(self.fd).st_size
                problem = self._inspect(size)
                if problem is None:
                    return
        except (OSError, ValueError) as exc:
            raise StoreUnavailable(f"LMDB {self.where}: cannot check data.mdb: {exc}; "
                                   "check the disk") from exc
        assert problem is not None
        raise self.fail(problem)

    def _inspect(self, size: int) -> str | None:
        """What is wrong with data.mdb at ``size`` bytes (None: nothing; then remembered
        in ``verified``, with the size its meta pages need)."""
        psize = self.psize
        if size < 2 * psize:
            return f"data.mdb is {size} bytes, shorter than its two meta pages"
        if not self.parse:  # another LMDB format: what LMDB says is in use must be there
            used = (self.env.info()["last_pgno"] + 1) * psize
            return None if used <= size else (
                f"data.mdb is {size} bytes but {used} are in use: it was truncated")
        metas = self.metas
        if metas is None:
            metas = self.metas = mmap.mmap(self.fd, 2 * psize, access=mmap.ACCESS_READ)
        meta0, meta1 = metas[:_META.size], metas[psize:psize + _META.size]
        problem = _meta_problem(meta0, 0, size, psize) or _meta_problem(meta1, 1, size, psize)
        if problem is None:
            self.verified = (meta0, meta1, psize * (1 + max(
                _META.unpack(meta0)[12], _META.unpack(meta1)[12])))
        return problem


def _meta_problem(meta: bytes, page: int, size: int, psize: int) -> str | None:
    """What is wrong with ``meta``, the start of meta page ``page``, for a data.mdb of
    ``size`` bytes; None: nothing."""
    (pgno, flags, magic, version, _map_size, page_size, free_flags, free_depth, free_root,
     main_flags, main_depth, main_root, last, _txnid) = _META.unpack(meta)
    used = (last + 1) * psize
    if (pgno, flags, magic, version, page_size) != (
            page, _P_META, _META_MAGIC, _META_VERSION, psize):
        return f"meta page {page} was overwritten"
    if used > size:
        return (f"meta page {page} says {used} bytes are in use, data.mdb holds {size}: "
                "it was truncated")
    if not (last >= 1 and free_flags == _INTEGERKEY and main_flags == 0
            and free_depth <= _MAX_DEPTH and main_depth <= _MAX_DEPTH
            and (free_root == _P_INVALID or 2 <= free_root <= last)
            and (main_root == _P_INVALID or 2 <= main_root <= last)):
        return f"meta page {page} is inconsistent"
    return None


def _page_size(psize: int) -> bool:
    return 512 <= psize <= 1 << 16 and not psize & (psize - 1)


def file_problem(path: str) -> str | None:
    """What is wrong with ``path``/data.mdb, read with ``pread`` (never mapped): for when
    LMDB fails to open it with an error that does not say (a damaged meta page can make
    it map terabytes: "Cannot allocate memory"). None: nothing found, or no such file."""
    if not _KNOWN_FORMAT:
        return None
    try:
        fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _META.size, 0)
        if len(head) < _META.size:
            return f"data.mdb is {size} bytes, shorter than its meta pages" if size else None
        psize = _META.unpack(head)[5]
        if not _page_size(psize):
            return "meta page 0 was overwritten"
        meta1 = os.pread(fd, _META.size, psize)
        if len(meta1) < _META.size:
            return f"data.mdb is {size} bytes, shorter than its two meta pages"
        return _meta_problem(head, 0, size, psize) or _meta_problem(meta1, 1, size, psize)
    except OSError:
        return None
    finally:
        os.close(fd)
