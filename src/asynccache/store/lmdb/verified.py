"""Verify, then trust: data.mdb's B-trees walked (walk.py) before LMDB reads a file in a
state not seen before, and a record of the states walked, so that a later open, or a
DataLoader worker's, skips the walk (docs/design.md, "LMDB", says why).

The walk costs ~1–3 µs per stored value (1 GiB holding 300,000 small values and 2,000 of
500 KB: ~0.5 s), so it runs only when the file changed since the last state recorded:
``asynccache-verified`` beside data.mdb holds the file's identity (device, inode, size,
mtime, the committed transaction id) after a clean walk. Any commit changes it, so the
next process to open the file walks it again. (Moving the record on with this
package's own synced commits was tried: in one DataLoader test under load, 2 of 33 runs
then recomputed values in epoch 2, 0 of 27 without it; left for a later change.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from . import layout
from .walk import Damage, walk

__all__ = ["RECORD", "Identity", "identity", "problem", "record", "recorded"]

log = logging.getLogger("asynccache.lmdb")

#: the record's file name, beside data.mdb and lock.mdb
RECORD = "asynccache-verified"
#: a walk this slow is logged at INFO (the time an open took is explained)
_SLOW = 1.0


@dataclass(frozen=True)
class Identity:
    """What tells one state of data.mdb from another: any commit changes ``txnid`` and
    ``mtime_ns``; an overwrite by another program changes ``mtime_ns``; a copy or a new
    file changes ``inode``."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    txnid: int


def identity(fd: int, psize: int) -> Identity | None:
    """data.mdb's identity now (``fd`` open on it, ``psize`` its page size); None when
    its meta pages cannot be read."""
    stat = os.fstat(fd)
    txnids = [os.pread(fd, layout.TXNID.size, page * psize + layout.TXNID_AT)
              for page in (0, 1)]
    if any(len(raw) != layout.TXNID.size for raw in txnids):
        return None
    txnid = max(layout.TXNID.unpack(raw)[0] for raw in txnids)
    return Identity(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, txnid)


def recorded(path: str) -> Identity | None:
    """The identity of the state last walked (or reached by a trusted commit)."""
    try:
        with open(os.path.join(path, RECORD), encoding="ascii") as file:
            return Identity(**json.load(file))
    except (OSError, ValueError, TypeError):
        return None  # none yet, or unreadable: the next open walks


def record(path: str, state: Identity) -> None:
    """Write the record (renamed into place: a reader never sees half of one). A record
    that cannot be written costs the next open a walk, nothing else."""
    final = os.path.join(path, RECORD)
    temporary = f"{final}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="ascii") as file:
            json.dump(asdict(state), file)
        os.replace(temporary, final)
    except OSError as exc:
        log.debug("cannot write %s (%s): the next open walks data.mdb again", final, exc)
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def problem(env: Any, path: str, fd: int, psize: int) -> str | None:
    """What the walk finds wrong with ``path``/data.mdb (None: nothing), or None at once
    when the file is in the state last recorded; a clean walk is recorded.

    A read transaction is held during the walk: a writer in another process then reuses
    no page that the committed meta page reaches (LMDB frees a page only for writers
    after every reader that could see it), so its commits cannot show the walk a
    half-rewritten tree. A meta page caught while being written can still fail a walk,
    so a failed walk is repeated once, after a pause, before it counts."""
    before = identity(fd, psize)
    if before is not None and before == recorded(path):
        return None
    found: str | None = None
    for attempt in range(2):
        if attempt:
            time.sleep(0.05)
            before = identity(fd, psize)
        started = time.perf_counter()
        with env.begin():
            found = _walk_committed(fd, psize)
        took = time.perf_counter() - started
        if found is None:
            break
    if found is not None:
        return found
    (log.info if took >= _SLOW else log.debug)(
        "verified %s/data.mdb (%d MiB) in %.2f s; not again until another program "
        "changes it", path, (before.size if before else 0) >> 20, took)
    after = identity(fd, psize)
    if after is not None and after == before:  # nothing committed during the walk
        record(path, after)
    return None


def _walk_committed(fd: int, psize: int) -> str | None:
    """Walk the trees of the meta page with the higher transaction id, as LMDB picks."""
    size = os.fstat(fd).st_size
    metas = [os.pread(fd, layout.META.size, page * psize) for page in (0, 1)]
    for page, raw in enumerate(metas):
        if len(raw) != layout.META.size:
            return f"data.mdb is {size} bytes, shorter than its meta pages"
        wrong = layout.meta_problem(raw, page, size, psize)
        if wrong is not None:
            return wrong
    committed = max((layout.parse_meta(raw) for raw in metas), key=lambda meta: meta.txnid)
    try:
        walk(fd, committed)
    except Damage as exc:
        return str(exc)
    return None
