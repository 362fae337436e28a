"""LMDB 0.9's file format, the parts this package reads itself (mdb.c: ``MDB_page``,
``MDB_node``, ``MDB_meta``), on a 64-bit little-endian build: the meta pages checked
before each batch (damage.py) and the pages walked at open (walk.py)."""

from __future__ import annotations

import struct
from typing import NamedTuple

from .package import lmdb

#: LMDB's own format is the one parsed here (py-lmdb bundles 0.9)
KNOWN_FORMAT = lmdb.version()[:2] == (0, 9)

#: a page's header: page number; pad, flags; lower and upper bounds of the free space
#: (an overflow page: the number of pages of its run, in the place of lower and upper)
PAGE = struct.Struct("<Q2xHHH")
PAGE_HEADER = PAGE.size  # 16
OVERFLOW_PAGES = struct.Struct("<I")  # at offset 12 of an overflow page
#: a node: lo, hi (a leaf's data size; a branch's child page, with flags), flags, key size
NODE = struct.Struct("<HHHH")
NODE_HEADER = NODE.size  # 8
TXNID = struct.Struct("<Q")  # a free-page DB key; a page number in an IDL

#: the meta page (a page header, then MDB_meta), the fields read: page number, page
#: flags; magic, data version, map size; the free-page DB's md_pad (the page size),
#: flags, depth, root; the main DB's flags, depth, root; last page, txnid.
META = struct.Struct("<Q2xH4xII8xQIHH32xQ4xHH32xQQQ")
META_MAGIC = 0xBEEFC0DE
META_VERSION = 1        # MDB_DATA_VERSION of LMDB 0.9
TXNID_AT = META.size - TXNID.size  # the txnid's offset in a meta page

P_BRANCH = 0x01
P_LEAF = 0x02
P_OVERFLOW = 0x04
P_META = 0x08
P_INVALID = (1 << 64) - 1   # an empty tree's root
F_BIGDATA = 0x01            # a leaf node whose value is in overflow pages
INTEGERKEY = 0x08           # the free-page DB's flags
MAX_DEPTH = 32              # CURSOR_STACK


class Meta(NamedTuple):
    pgno: int
    flags: int
    magic: int
    version: int
    map_size: int
    psize: int
    free_flags: int
    free_depth: int
    free_root: int
    main_flags: int
    main_depth: int
    main_root: int
    last: int
    txnid: int


def parse_meta(raw: bytes) -> Meta:
    """The fields of a meta page from its first `META.size` bytes."""
    return Meta._make(META.unpack(raw))


def page_size_ok(psize: int) -> bool:
    return 512 <= psize <= 1 << 16 and not psize & (psize - 1)


def overflow_pages(size: int, psize: int) -> int:
    """OVPAGES: pages of an overflow run holding a value of ``size`` bytes."""
    return (PAGE_HEADER - 1 + size) // psize + 1


def meta_problem(meta: bytes, page: int, size: int, psize: int) -> str | None:
    """What is wrong with ``meta``, the start of meta page ``page``, for a data.mdb of
    ``size`` bytes; None: nothing."""
    m = parse_meta(meta)
    used = (m.last + 1) * psize
    if (m.pgno, m.flags, m.magic, m.version, m.psize) != (
            page, P_META, META_MAGIC, META_VERSION, psize):
        return f"meta page {page} was overwritten"
    if used > size:
        return (f"meta page {page} says {used} bytes are in use, data.mdb holds {size}: "
                "it was truncated")
    last = m.last
    if not (last >= 1 and m.free_flags == INTEGERKEY and m.main_flags == 0
            and m.free_depth <= MAX_DEPTH and m.main_depth <= MAX_DEPTH
            and (m.free_root == P_INVALID or 2 <= m.free_root <= last)
            and (m.main_root == P_INVALID or 2 <= m.main_root <= last)):
        return f"meta page {page} is inconsistent"
    return None
