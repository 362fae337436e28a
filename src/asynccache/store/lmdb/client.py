"""LMDB: a store on one machine with no server, shared by every process and every run.

Why it is built this way: docs/design.md, "LMDB".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import struct
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import asdict
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ...errors import (
    ConfigError,
    InvalidURL,
    KeyTooLong,
    StoreError,
    StoreRejected,
    StoreUnavailable,
)
from ..api import AnsweredAtSend, ConsumerReads, NodeName, WriteResult
from ..credentials import mask_url
from ..provider import Provider
from ..url_options import flag
from .damage import EnvironmentDamaged
from .environment import Settings, session, using, writer
from .package import lmdb

__all__ = ["HEADER", "EnvironmentDamaged", "LmdbClient", "pack_value", "unpack_value"]

T = TypeVar("T")

#: magic, expiry (Unix time, 0.0: never)
HEADER = struct.Struct("<4sd")
MAGIC = b"acL\x01"
_MAX_KEY = 511
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*", re.IGNORECASE)


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
        verify: bool | str = True,
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
        self.settings = Settings(path=where, map_size=parse_size(map_size),
                                  max_readers=readers, max_spare_txns=spare,
                                  sync=flag("sync", sync),
                                  readahead=flag("readahead", readahead),
                                  verify=flag("verify", verify))
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
        return using(self.settings, self.safe_url)

    # -- reads: in the calling thread ---------------------------------------------------
    def read_now(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values for ``keys`` in one read transaction, here and now (any thread)."""
        if not keys:
            return []
        now = time.time()
        out: list[bytes | None] = []
        try:
            with session(self.settings, self.safe_url) as held, \
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
            with session(self.settings, self.safe_url) as held, \
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
                with session(self.settings, self.safe_url) as held, \
                        held.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.Error as exc:
                raise self._translate(exc, what) from exc

        return await asyncio.get_running_loop().run_in_executor(writer(), run)

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
        values that still fit are written and only the others are rejected. A full map
        refuses keys (``rejected``), whatever the batch's size: the node answered."""
        result = await super().write(entries, ttl, skip)
        node = self.node_names[0]
        refused = result.failures.get(node)
        if not isinstance(refused, StoreRejected):
            return result
        if len(entries) < 2:
            return WriteResult(answered=[node], rejected=dict.fromkeys(entries, refused))
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
            with session(self.settings, self.safe_url) as held, \
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
        if "@" in parts.netloc:  # credentials: lmdb:// takes none, and they stay unsaid
            raise InvalidURL(f"{mask_url(url)!r}: lmdb:// takes no user name or password; "
                             "write lmdb:///abs/path/to/dir")
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
