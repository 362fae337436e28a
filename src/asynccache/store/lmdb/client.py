"""LMDB: a store on one machine with no server, shared by every process and every run.

``lmdb:///path/to/dir?map_size=64GiB`` keeps the cache in an LMDB environment (a
memory-mapped B+tree file, ``data.mdb`` plus ``lock.mdb``, in that directory). Every
DataLoader worker opens the same files; readers never block writers or each other, and
the data survives the job. Built on the public :class:`~asynccache.Provider`
interface, like a third-party store would be.

Choices, and why:

* **One environment per process and path, closed across fork.** LMDB forbids opening
  one environment twice in a process (its POSIX locks would be released by the second
  close) and using one across ``fork``; py-lmdb refuses to open files that are already
  open, which a forked child's inherited environment would be. So environments live in
  a per-process table keyed by path: every client on that path in this process shares
  one. Before this process forks (a DataLoader starting ``fork`` workers), it closes
  them once no operation is using one (operations meanwhile wait); the child starts
  with none, and both reopen on first use. A pickle carries only the path and the
  options. The first client to open a path in a process decides its options.
  ``reader_check()`` at each open frees reader slots left by killed workers.
* **Reads** run where they are asked, in one read transaction per batch, through the
  memory map (``buffers=True``: LMDB hands out a view of the mapped page and the value
  is copied once, after the expiry header; ``buffers=False`` would copy it twice;
  measured 1.2 against 1.5 µs per 4 KiB value, 104 against 107 µs per 256 KiB).
  They take microseconds, so they run on the event loop without a thread, and on the
  consumer's own thread for read-ahead (:meth:`LmdbClient.consumer_reads`): a
  ``dp[i]`` hit is a read transaction in the calling thread, with no thread hop.
* **Writes** (``set_many``, ``add_many``, ``delete_many``) are one write transaction
  per call, run in a single writer thread per process. LMDB has one writer at a time
  across all processes: a worker may wait for another worker's commit (and its
  ``fsync``), and that wait must not stall this process' event loop, whose read-ahead
  is what the consumer is waiting on. The operation is bounded by ``timeout``; a write
  that times out may still commit afterwards.
* **Expiry**: LMDB has none, so each value carries a 12-byte header (magic and the
  expiry as a Unix timestamp, wall clock: it must mean the same in every process and
  after a restart). An expired value reads as absent and stays on disk until it is
  overwritten or deleted (deleting it on read would turn reads into writes). Bytes
  without the header (written by something else) are handed to the codec as they
  are, which refuses them: a counted decode error and a miss, never a wrong value.
* **No eviction.** When the map is full a write fails with ``StoreRejected`` saying to
  raise ``map_size`` (counted as ``rejected``; training goes on, those values are not
  cached); the batch is then retried key by key, so the values that still fit are
  written. Size ``map_size`` for the dataset or set a ``ttl``. A large ``map_size``
  costs address space, not disk: the file grows as it is written.
* Keys are at most 511 bytes (LMDB's limit): longer keys are a ``KeyTooLong``.
* **Damaged files** (truncated, overwritten, torn by a machine crash with ``sync=false``)
  are counted misses, not a dead process. LMDB maps data.mdb and checks what it reads
  of the B-tree (py-lmdb 3's patched 0.9: page types and bounds, leaf values within
  their page, page numbers below the last page in use), but not that the file still
  holds those pages: touching one past the end of the file is SIGBUS. So each batch
  (read, scan, write: ~1.5 µs) first compares data.mdb's size with what both meta pages
  say is in use and checks the meta pages (magic, page size, roots below the last
  page); a failed check, LMDB's own "corrupted" errors, or a failed open with damaged
  meta pages raise :class:`EnvironmentDamaged` (a ``StoreUnavailable``: counted, the
  node backed off, logged once, naming the directory to delete), and this process does
  not use the environment again. What no check in this process can stop, because it
  happens in C before Python sees anything: a damaged data size of a value kept in
  overflow pages (checked by neither LMDB nor py-lmdb, whose ``get`` touches a byte of
  every page of the value before returning); damaged node offsets in one of the file's
  last 16 pages (LMDB reads a node up to 64 KiB past its page); and a file truncated
  while a batch is reading it. Both kinds of damage faulted every time in experiments
  (SIGBUS). No open-time check is made for them: a walk over the keys does not touch
  values, a walk over the values reads the whole file, and neither sees later damage.

Options (URL query or keywords): ``map_size`` (bytes, or ``64GiB``/``512MiB``/``1TB``;
default 1 GiB), ``max_readers`` (reader slots for all processes together, default
512: each process holds one per thread reading at a time plus ``max_spare_txns``),
``sync`` (default true: ``fsync`` on commit; ``false`` is faster but a machine crash
may corrupt the file, then delete the directory), ``readahead`` (default true; false
helps when the cache is much larger than RAM and read at random), ``max_spare_txns``
(default 4), plus ``timeout``, ``connect_timeout``, ``max_batch``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ... import _fork
from ...errors import (
    CacheError,
    ConfigError,
    InvalidURL,
    KeyTooLong,
    MissingDependency,
    StoreError,
    StoreRejected,
    StoreUnavailable,
)
from ..api import AnsweredAtSend, ConsumerReads, NodeName, WriteResult
from ..provider import Provider

try:
    import lmdb
except ImportError as exc:  # pragma: no cover - the extra is installed in CI
    raise MissingDependency(
        "lmdb:// needs the lmdb package: pip install 'asynccache[lmdb]'") from exc

__all__ = ["HEADER", "EnvironmentDamaged", "LmdbClient", "pack_value", "unpack_value"]

T = TypeVar("T")

#: magic, expiry (Unix time, 0.0: never)
HEADER = struct.Struct("<4sd")
MAGIC = b"acL\x01"
_MAX_KEY = 511
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*", re.IGNORECASE)
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def pack_value(value: bytes, expires: float) -> bytes:
    """The stored form: header, then the value."""
    return HEADER.pack(MAGIC, expires) + value


def unpack_value(stored: Any, now: float) -> bytes | None:
    """The value in ``stored`` (bytes or a buffer of the map), None when expired; bytes
    without our header come back whole (the codec refuses them, counted)."""
    if len(stored) < HEADER.size or stored[:4] != MAGIC:
        return bytes(stored)
    _magic, expires = HEADER.unpack_from(stored)
    if expires and expires <= now:
        return None
    return bytes(stored[HEADER.size:])


def parse_size(value: int | str, option: str = "map_size") -> int:
    """Bytes from an int or ``"64GiB"``, ``"512MB"``, ``"1t"`` (powers of 1024 either way:
    page-sized maps, not disk marketing)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.fullmatch(str(value))
        if match is None:
            raise InvalidURL(f"{option}={value!r} is not a size: write bytes or e.g. 64GiB")
        number, unit = float(match.group(1)), match.group(2).lower()
        size = int(number * 1024 ** " kmgtp".index(unit or " "))
    if size < 1 << 16:
        raise ConfigError(f"{option}={value!r} is too small: give at least 64KiB")
    return size


def _flag(option: str, value: bool | str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise InvalidURL(f"option {option}={value!r} is not true or false")


@dataclass(frozen=True)
class _Settings:
    path: str
    map_size: int
    max_readers: int
    max_spare_txns: int
    sync: bool
    readahead: bool


# -- per-process state: environments and the writer thread ----------------------------------
#: How long a fork waits for this process' LMDB operations in flight to finish, so that
#: it can close the environments first (see _before_fork).
FORK_WAIT = 10.0


class _Process:
    """This process' environments (by real path), their users, its writer thread."""

    def __init__(self) -> None:
        self.envs: dict[str, _Env] = {}
        self.writer: concurrent.futures.ThreadPoolExecutor | None = None
        self.idle = threading.Condition(threading.Lock())
        self.users = 0          # operations between begin and end of their transaction
        self.forking = False    # a fork is closing the environments: wait


_process = _Process()


def _before_fork() -> None:
    """Close every environment before the process forks, once no operation is using one.

    A forked child must not use its parent's environment (its reader slots carry the
    parent's pid, and it holds none of the parent's file locks), must not close it
    either (aborting the inherited transactions would free reader slots the parent
    still uses), and py-lmdb refuses to open the same files again while it is open.
    So the parent closes them here (new operations wait), the child starts with none,
    and both reopen on first use. If operations are still running after ``FORK_WAIT``
    seconds the environments stay open, and the child's LMDB operations fail (counted
    store errors: values are computed).
    """
    proc = _process
    if not proc.envs:
        return
    with proc.idle:
        proc.forking = True
        deadline = time.monotonic() + FORK_WAIT
        while proc.users and (left := deadline - time.monotonic()) > 0:
            proc.idle.wait(left)
        if not proc.users:
            for held in proc.envs.values():
                held.close()
            proc.envs.clear()


def _after_fork_in_parent() -> None:
    proc = _process
    if proc.forking:
        with proc.idle:
            proc.forking = False
            proc.idle.notify_all()


def _after_fork_in_child() -> None:
    global _process
    _fork.park_inherited(_process)  # its lock may be held, its thread is gone
    _process = _Process()


_fork.at_fork(before=_before_fork, in_parent=_after_fork_in_parent, in_child=_after_fork_in_child)


@contextlib.contextmanager
def _session(settings: _Settings, where: str) -> Iterator[_Env]:
    """This process' environment for ``settings.path``, opened on first use and checked
    (:meth:`_Env.check`) each time, counted as in use (a fork waits) until the block
    ends: begin and end transactions inside it. LMDB's reports of damage inside the
    block become an :class:`EnvironmentDamaged`, and the environment is not used again
    in this process."""
    proc = _process
    with proc.idle:
        while proc.forking:
            proc.idle.wait()
        held = proc.envs.get(settings.path)
        if held is None:
            held = proc.envs[settings.path] = _open(settings, where)
        proc.users += 1
    try:
        held.check()
        yield held
    except _DAMAGE as exc:
        raise held.fail(f"LMDB found it inconsistent ({type(exc).__name__}: {exc})") from exc
    finally:
        with proc.idle:
            proc.users -= 1
            if not proc.users and proc.forking:
                proc.idle.notify_all()


@contextlib.contextmanager
def _using(settings: _Settings, where: str) -> Iterator[Any]:
    """Like :func:`_session`, yielding only the ``lmdb.Environment``."""
    with _session(settings, where) as held:
        yield held.env


def _open(settings: _Settings, where: str) -> _Env:
    try:
        os.makedirs(settings.path, exist_ok=True)
        env = lmdb.open(settings.path, map_size=settings.map_size,
                        max_readers=settings.max_readers,
                        max_spare_txns=settings.max_spare_txns, sync=settings.sync,
                        metasync=settings.sync, readahead=settings.readahead, lock=True,
                        subdir=True, create=True)
    except (OSError, lmdb.Error) as exc:
        if "already open in this process" in str(exc):
            raise StoreUnavailable(
                f"LMDB {where}: this process was forked while its parent was still using "
                f"the environment (for over {FORK_WAIT:g}s), so it cannot open it; start "
                "DataLoader workers with multiprocessing_context='spawn' or 'forkserver', "
                "or fork while no LMDB write is pending") from exc
        problem = _file_problem(settings.path)
        if problem is not None or isinstance(exc, _DAMAGE):
            raise EnvironmentDamaged(_damaged(
                where, settings.path, problem or f"LMDB refused to open it "
                f"({type(exc).__name__}: {exc})")) from exc
        raise StoreUnavailable(
            f"cannot open the LMDB environment {where}: {exc}; check that the directory "
            "exists or can be created, and that this user may write it (LMDB needs write "
            "access for its lock file even to read)") from exc
    try:
        env.reader_check()  # reader slots of processes that died (a killed worker)
    except lmdb.Error:
        pass
    try:
        return _Env(env, settings.path, where)
    except OSError as exc:
        env.close()
        raise StoreUnavailable(f"LMDB {where}: cannot open data.mdb to check it: {exc}; "
                               "check the directory's permissions") from exc


# -- damage: what LMDB does not check -------------------------------------------------------
class EnvironmentDamaged(StoreUnavailable):
    """The environment's files are damaged (truncated, overwritten): this process no
    longer reads or writes it, and the message names the directory to delete."""


#: lmdb errors that mean the files are damaged, not that an operation failed (MDB_PANIC
#: may follow a failed write, a full disk: a plain store error)
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError)

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


def _damaged(where: str, path: str, reason: str) -> str:
    return (f"LMDB {where} is damaged: {reason}. asynccache no longer reads or writes it in "
            "this process (values are computed from the source); stop the jobs that use it "
            f"and delete the directory {path} (the cache is rebuilt as it is used)")


class _Env:
    """An open environment, and the checks that keep its files from killing the process.

    LMDB maps data.mdb into memory and trusts it. It checks what it reads of the B-tree
    (page types and bounds, leaf values within their page, page numbers below the last
    page in use), but not that the file still holds those pages: touching one past the
    end of the file raises SIGBUS. So before each batch :meth:`check` compares the
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
            self.damage = _damaged(self.where, self.path, reason)
        return EnvironmentDamaged(self.damage)

    def check(self) -> None:
        """Raise :class:`EnvironmentDamaged` unless data.mdb holds every page in use and
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


def _file_problem(path: str) -> str | None:
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


def _writer() -> concurrent.futures.ThreadPoolExecutor:
    proc = _process
    if proc.writer is None:
        with proc.idle:
            if proc.writer is None:
                proc.writer = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="asynccache-lmdb-writer")
    return proc.writer


class LmdbClient(Provider):
    """An LMDB environment in a directory, shared by the processes of one machine."""

    scheme = "lmdb"
    max_value_size = None

    def __init__(
        self,
        url: str | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        map_size: int | str = 1 << 30,
        max_readers: int | str = 512,
        max_spare_txns: int | str = 4,
        sync: bool | str = True,
        readahead: bool | str = True,
        **options: Any,
    ) -> None:
        """``url`` (``lmdb:///abs/dir``, three slashes) or ``path`` (relative to the
        current directory, or absolute)."""
        if (url is None) == (path is None):
            raise ConfigError("LmdbClient needs a url (lmdb:///path/to/dir) or a path, not "
                              "both")
        where = os.fspath(path) if path is not None else _path_of(str(url))
        where = os.path.abspath(os.path.expanduser(where))
        super().__init__(f"lmdb://{where}", **options)
        try:
            readers, spare = int(max_readers), int(max_spare_txns)
        except ValueError:
            raise InvalidURL(f"max_readers={max_readers!r} and max_spare_txns="
                             f"{max_spare_txns!r} must be whole numbers") from None
        if readers < 1 or spare < 0:
            raise ConfigError("max_readers must be at least 1 and max_spare_txns at least 0")
        self.settings = _Settings(path=where, map_size=parse_size(map_size),
                                  max_readers=readers, max_spare_txns=spare,
                                  sync=_flag("sync", sync),
                                  readahead=_flag("readahead", readahead))
        _check_writable(where)

    @property
    def path(self) -> str:
        return self.settings.path

    @property
    def safe_url(self) -> str:
        return f"lmdb://{self.path}"

    def using(self) -> contextlib.AbstractContextManager[Any]:
        """``with client.using() as env``: this process' environment for the path
        (opened on first use); begin and end transactions inside the block."""
        return _using(self.settings, self.safe_url)

    # -- reads: in the calling thread ---------------------------------------------------
    def read_now(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values for ``keys`` in one read transaction, here and now (any thread)."""
        if not keys:
            return []
        now = time.time()
        out: list[bytes | None] = []
        try:
            with _session(self.settings, self.safe_url) as held, \
                    held.env.begin(buffers=True) as txn:
                get = txn.get
                for key in keys:
                    stored = get(key)
                    out.append(None if stored is None else unpack_value(stored, now))
        except lmdb.Error as exc:
            raise self._translate(exc, "read") from exc
        return out

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.read_now(keys)

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        now = time.time()
        try:
            with _session(self.settings, self.safe_url) as held, \
                    held.env.begin(buffers=True) as txn:
                return [_alive(txn.get(key), now) for key in keys]
        except lmdb.Error as exc:
            raise self._translate(exc, "read") from exc

    def consumer_reads(self) -> ConsumerReads:
        """Read-ahead as read transactions on the consumer's own thread."""
        return ConsumerReads([_ConsumerConnection(self)])

    # -- writes: one transaction each, on this process' writer thread -------------------
    async def _write(self, fn: Callable[[Any], T], what: str) -> T:
        def run() -> T:
            try:
                with _session(self.settings, self.safe_url) as held, \
                        held.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.Error as exc:
                raise self._translate(exc, what) from exc

        return await asyncio.get_running_loop().run_in_executor(_writer(), run)

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        if not mapping:
            return
        expires = 0.0 if ttl is None else time.time() + ttl
        items = [(key, pack_value(bytes(value), expires)) for key, value in mapping.items()]

        def put(txn: Any) -> None:
            for key, stored in items:
                txn.put(key, stored)

        await self._write(put, "write")

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        """One transaction for the batch; when the map is full, one per key, so that the
        values that still fit are written and only the others are rejected."""
        result = await super().write(entries, ttl, skip)
        node = self.node_names[0]
        if len(entries) < 2 or not isinstance(result.failures.get(node), StoreRejected):
            return result
        out = WriteResult(answered=[node])
        for key, value in entries.items():
            try:
                await self.set_many({key: value}, ttl)
            except StoreRejected as exc:
                out.rejected[key] = exc
            except StoreError as exc:
                out.failures[node] = exc
                out.failed_keys += 1
            else:
                out.written += 1
        return out

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        if not entries:
            return []
        now = time.time()
        items = [(key, pack_value(bytes(value), now + ttl)) for key, value in entries.items()]

        def add(txn: Any) -> list[bool]:
            added = []
            for key, stored in items:
                if _alive(txn.get(key), now):
                    added.append(False)
                else:
                    txn.put(key, stored)
                    added.append(True)
            return added

        return await self._write(add, "write")

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        wanted = list(keys)

        def delete(txn: Any) -> None:
            for key in wanted:
                txn.delete(key)

        await self._write(delete, "delete")

    # -- administration ---------------------------------------------------------------------
    async def ping(self) -> None:
        try:
            with self.using() as env:
                env.stat()
        except lmdb.Error as exc:
            raise self._translate(exc, "stat") from exc

    async def server_info(self) -> dict[str, Any]:
        with self.using() as env:
            info, stat, max_key = env.info(), env.stat(), env.max_key_size()
        return {
            "version": "lmdb {}.{}.{}".format(*lmdb.version()),
            "py-lmdb": lmdb.__version__,
            "path": self.path,
            "map_size": info["map_size"],
            "used_bytes": (info["last_pgno"] + 1) * stat["psize"],
            "entries": stat["entries"],
            "max_readers": info["max_readers"],
            "readers_in_use": info["num_readers"],
            "max_key_size": max_key,
            "max_value_size": self.max_value_size,
            "eviction": None,  # LMDB never evicts: size map_size or set a ttl
            "settings": asdict(self.settings),
        }

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        """Keys under ``prefix`` with the size of their value (header excluded), in key
        order, expired ones included: LMDB never evicts, so an expired value holds its
        room in the map until it is deleted, and ``asynccache flush`` (which deletes what
        this lists) is how an operator gets it back; ``stats`` counts what is stored.
        One short read transaction per batch (a long one would keep old pages from
        being reused while the caller works)."""
        after: bytes | None = None
        while True:
            found = self._scan_batch(prefix, after, max(1, batch))
            if found:
                yield found
            if len(found) < batch:
                return
            after = found[-1][0]
            await asyncio.sleep(0)

    def _scan_batch(self, prefix: bytes, after: bytes | None, batch: int
                    ) -> list[tuple[bytes, int | None]]:
        out: list[tuple[bytes, int | None]] = []
        try:
            with _session(self.settings, self.safe_url) as held, \
                    held.env.begin(buffers=True) as txn, txn.cursor() as cursor:
                if not cursor.set_range(after or prefix):
                    return out
                for view, stored in cursor:
                    if len(view) > _MAX_KEY:  # a damaged key size, which LMDB does not check
                        raise held.fail(f"a key of {len(view)} bytes (LMDB's limit: 511)")
                    key = bytes(view)
                    if key == after:
                        continue
                    if not key.startswith(prefix) or len(out) >= batch:
                        break
                    out.append((key, _payload_size(stored)))
        except lmdb.Error as exc:
            raise self._translate(exc, "scan") from exc
        return out

    # -- errors -------------------------------------------------------------------------------
    def _translate(self, exc: Exception, what: str) -> Exception:
        where = self.safe_url
        settings = self.settings
        if isinstance(exc, lmdb.MapFullError):
            return StoreRejected(
                f"LMDB {where} is full (map_size={_human(settings.map_size)}) and never "
                "evicts: raise map_size "
                f"(e.g. lmdb://{settings.path}?map_size=64GiB; the file only grows as it is "
                "written), set a ttl, or delete old namespaces")
        if isinstance(exc, lmdb.BadValsizeError):
            return KeyTooLong(f"LMDB {where}: a key is empty or longer than LMDB's "
                              "511 bytes; use a shorter namespace or "
                              "key_fn")
        if isinstance(exc, lmdb.ReadersFullError):
            return StoreUnavailable(
                f"LMDB {where} has no free reader slot (max_readers="
                f"{settings.max_readers}): raise max_readers for this many processes and "
                "threads")
        if isinstance(exc, lmdb.MapResizedError):
            return StoreUnavailable(
                f"LMDB {where} was grown by a process with a larger map_size: give every "
                "process the same map_size")
        if isinstance(exc, lmdb.ReadonlyError | lmdb.DiskError) or (
                isinstance(exc, lmdb.Error) and "Permission denied" in str(exc)):
            return StoreUnavailable(f"LMDB {where} cannot {what}: {exc}; check the disk "
                                    "and the directory's permissions")
        return StoreError(f"LMDB {where} failed to {what}: {type(exc).__name__}: {exc}")


class _ConsumerConnection(AnsweredAtSend):
    """The consumer side: each request is a read transaction in the caller's thread."""

    def __init__(self, client: LmdbClient) -> None:
        super().__init__()
        self.client = client
        self.node = client.node_names[0]

    def read(self, keys: Sequence[bytes]) -> list[Any]:
        return self.client.read_now(keys)


def _human(size: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.4g}{unit}"
    return f"{size}B"


def _payload_size(stored: Any) -> int:
    """The size of a stored value without our header (bytes without it: all of them)."""
    if len(stored) < HEADER.size or stored[:4] != MAGIC:
        return len(stored)
    return len(stored) - HEADER.size


def _alive(stored: Any, now: float) -> bool:
    if stored is None:
        return False
    if len(stored) < HEADER.size or stored[:4] != MAGIC:
        return True
    expires = HEADER.unpack_from(stored)[1]
    return not expires or expires > now


def _path_of(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme.lower() != "lmdb":
        raise InvalidURL(f"not an lmdb URL: {url!r}; write lmdb:///path/to/dir")
    if parts.netloc:  # lmdb://relative/dir: "relative" is a host, the path depends on cwd
        meant = os.path.abspath(os.path.expanduser(unquote(parts.netloc + parts.path)))
        raise InvalidURL(f"{url!r} names a host ({parts.netloc!r}), not a directory: an "
                         "lmdb:// URL takes an absolute path, with three slashes: "
                         f"lmdb:///abs/path, e.g. lmdb://{meant} (or pass path= to LmdbClient "
                         "for a path relative to the current directory)")
    path = unquote(parts.path)
    if not path or path == "/":
        raise InvalidURL(f"{url!r} names no directory; write lmdb:///abs/path/to/dir")
    return path


def _check_writable(path: str) -> None:
    """The directory exists or can be made, and we may write it: said now, at connect(),
    rather than as a counted failure on every write."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"lmdb://{path} is not a directory; give the directory that "
                          "holds (or will hold) data.mdb")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"lmdb://{path}: cannot create the directory ({exc.strerror}); "
                          "choose a path this user may write") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"lmdb://{path}: this user may not write the directory (LMDB "
                          "needs it for its lock file, even to read); fix its permissions "
                          "or choose another path")
    data = os.path.join(path, "data.mdb")
    if os.path.exists(data) and not os.access(data, os.R_OK | os.W_OK):
        raise ConfigError(f"lmdb://{path}: data.mdb is not readable and writable by this "
                          "user; fix its permissions or choose another path")
