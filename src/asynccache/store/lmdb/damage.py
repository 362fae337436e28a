"""What LMDB does not check: damaged files (truncated, overwritten) found before a batch
touches them, so that they are counted misses instead of a SIGBUS (docs/design.md, "LMDB")."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import Any

from ...errors import CacheError, StoreUnavailable
from . import layout
from .package import lmdb
from .verified import problem

__all__ = ["DAMAGE", "Env", "EnvironmentDamaged", "damaged", "file_problem"]


class EnvironmentDamaged(StoreUnavailable):
    """The environment's files are damaged (truncated, overwritten): this process no
    longer reads or writes it, and the message names the directory to delete."""


#: lmdb errors that mean the files are damaged, not that an operation failed (MDB_PANIC
#: may follow a failed write, a full disk: a plain store error)
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError)

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
            head = os.pread(self.fd, layout.META.size, 0)
            fields = layout.parse_meta(head) if len(head) == layout.META.size else None
        except OSError:
            fields = None
        # the meta pages are parsed only in the format known here; LMDB accepted this file
        # a moment ago, so a meta page that does not parse means another format
        self.parse = bool(layout.KNOWN_FORMAT and fields and fields.magic == layout.META_MAGIC
                          and fields.version == layout.META_VERSION
                          and layout.page_size_ok(fields.psize))
        self.psize = fields.psize if self.parse and fields else mmap.PAGESIZE
        with contextlib.suppress(CacheError):
            self.check()  # damage found here is kept, and raised on first use

    def close(self) -> None:
        self.env.close()
        if self.metas is not None:
            self.metas.close()
        os.close(self.fd)

    def verify(self) -> None:
        """Walk data.mdb's B-trees unless the file is in the state last verified
        (`verified.problem`); damage found is kept, and raised on first use.
        Only in the format known here, after `check()` found the meta pages sane."""
        if self.damage is not None or not self.parse:
            return
        found = problem(self.env, self.path, self.fd, self.psize)
        if found is not None:
            self.fail(f"the check at open found: {found}")

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
            if (size >= needed and metas is not None and metas[:layout.META.size] == meta0
                    and metas[psize:psize + layout.META.size] == meta1):
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
        meta0, meta1 = metas[:layout.META.size], metas[psize:psize + layout.META.size]
        problem = (layout.meta_problem(meta0, 0, size, psize)
                   or layout.meta_problem(meta1, 1, size, psize))
        if problem is None:
            self.verified = (meta0, meta1, psize * (1 + max(
                layout.parse_meta(meta0).last, layout.parse_meta(meta1).last)))
        return problem


def file_problem(path: str) -> str | None:
    """What is wrong with ``path``/data.mdb, read with ``pread`` (never mapped): for when
    LMDB fails to open it with an error that does not say (a damaged meta page can make
    it map terabytes: "Cannot allocate memory"). None: nothing found, or no such file."""
    if not layout.KNOWN_FORMAT:
        return None
    try:
        fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, layout.META.size, 0)
        if len(head) < layout.META.size:
            return f"data.mdb is {size} bytes, shorter than its meta pages" if size else None
        psize = layout.parse_meta(head).psize
        if not layout.page_size_ok(psize):
            return "meta page 0 was overwritten"
        meta1 = os.pread(fd, layout.META.size, psize)
        if len(meta1) < layout.META.size:
            return f"data.mdb is {size} bytes, shorter than its two meta pages"
        return (layout.meta_problem(head, 0, size, psize)
                or layout.meta_problem(meta1, 1, size, psize))
    except OSError:
        return None
    finally:
        os.close(fd)
