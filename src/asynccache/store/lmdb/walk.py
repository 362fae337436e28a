"""A walk over data.mdb's B-trees that checks what LMDB trusts when it reads them, with
``pread`` (never the map: a damaged or short file is a finding here, not a SIGBUS).

LMDB checks page types and page numbers, but follows a leaf page's node offsets and a
value's size as it finds them: garbage there makes it, or py-lmdb (which touches every
page of a value before returning it), read past the end of the file in C. This walk
checks, for every page the committed meta page reaches in both trees (the values, and
the free pages a writer reuses):

* each page number is in use (2 … last page), reached once, and stored in its page;
  branch pages above the tree's depth, leaf pages at it;
* every node offset and node (header, key, and a value kept in the page) lies inside the
  page, after the page's node offsets;
* a value kept in overflow pages points at an overflow page in use whose run holds it
  (``mp_pages`` at least what its size needs: LMDB keeps a longer run when it overwrites
  a value with a shorter one in the same transaction) and ends before the last page;
* a free-page list (IDL) holds as many page numbers as it says, each in use.

It checks no key order or counters: garbage there is a miss, not a crash. ~1 µs per
value kept in a leaf page, ~3 µs per value in overflow pages (one header read).
"""

from __future__ import annotations

import os
import struct

from . import layout
from .layout import F_BIGDATA, NODE, NODE_HEADER, P_BRANCH, P_LEAF, PAGE, PAGE_HEADER

__all__ = ["Damage", "walk"]


class Damage(Exception):
    """What the walk found (its message names the page)."""


def walk(fd: int, meta: layout.Meta) -> None:
    """Raise `Damage` at the first thing in ``fd`` (data.mdb) that LMDB would trust
    wrongly in the state ``meta`` describes (a meta page already checked by
    ``damage._meta_problem``)."""
    tree = _Trees(fd, meta.psize, meta.last)
    tree.walk("main", meta.main_root, meta.main_depth, free_lists=False)
    tree.walk("free-page", meta.free_root, meta.free_depth, free_lists=True)


class _Trees:
    def __init__(self, fd: int, psize: int, last: int) -> None:
        self.fd = fd
        self.psize = psize
        self.last = last
        self.seen = bytearray(last + 1)  # tree pages reached, by page number

    def page(self, pgno: int) -> bytes:
        raw = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(raw) != self.psize:
            raise Damage(f"page {pgno} is past the end of data.mdb")
        return raw

    def walk(self, name: str, root: int, depth: int, free_lists: bool) -> None:
        if root == layout.P_INVALID:
            return
        psize = self.psize
        pending = [(root, 1)]
        while pending:
            pgno, level = pending.pop()
            where = f"{name} tree page {pgno}"
            if not 2 <= pgno <= self.last:
                raise Damage(f"{where} is not a page in use (the last is {self.last})")
            if self.seen[pgno]:
                raise Damage(f"{where} is reached twice")
            self.seen[pgno] = 1
            raw = self.page(pgno)
            stored, flags, lower, upper = PAGE.unpack_from(raw)
            want = P_BRANCH if level < depth else P_LEAF
            if stored != pgno or flags & (P_BRANCH | P_LEAF | layout.P_OVERFLOW) != want:
                raise Damage(f"{where} holds another page (number {stored}, flags "
                             f"{flags:#x}) at level {level} of {depth}")
            count = (lower - PAGE_HEADER) >> 1
            if not (PAGE_HEADER <= lower <= upper <= self.psize and not lower & 1 and count):
                raise Damage(f"{where} has bounds {lower}..{upper}")
            for slot, offset in enumerate(struct.unpack_from(f"<{count}H", raw, PAGE_HEADER)):
                if not upper <= offset <= psize - NODE_HEADER:
                    raise Damage(f"{where} node {slot} is at {offset}, outside the page")
                lo, hi, node_flags, key_size = NODE.unpack_from(raw, offset)
                end = offset + NODE_HEADER + key_size
                if want == P_BRANCH:
                    if end > psize:
                        raise Damage(f"{where} node {slot} runs past the page")
                    pending.append((lo | hi << 16 | node_flags << 32, level + 1))
                    continue
                size = lo | hi << 16
                if not (node_flags & F_BIGDATA or free_lists):  # most nodes: inline
                    if end + size > psize:
                        raise Damage(f"{where} node {slot}: its {size}-byte value runs "
                                     "past the page")
                    continue
                value = self.value(where, slot, raw, end, size, node_flags & F_BIGDATA,
                                   free_lists)
                if free_lists:
                    self.free_list(where, slot, value)

    def value(self, where: str, slot: int, raw: bytes, start: int, size: int,
              big: int, read: bool) -> bytes | None:
        """Check a leaf node's value; its bytes if ``read`` (a free-page list, kept in
        the page or in an overflow run)."""
        if not big:
            if start + size > self.psize:
                raise Damage(f"{where} node {slot}: its {size}-byte value runs past the page")
            return raw[start:start + size]
        if start + 8 > self.psize:
            raise Damage(f"{where} node {slot} runs past the page")
        (first,) = layout.TXNID.unpack_from(raw, start)
        pages = layout.overflow_pages(size, self.psize)
        if not (first >= 2 and first + pages - 1 <= self.last):
            raise Damage(f"{where} node {slot}: a {size}-byte value in overflow pages {first}.."
                         f"{first + pages - 1}, past the last page in use {self.last}")
        head = os.pread(self.fd, PAGE_HEADER, first * self.psize)
        if len(head) != PAGE_HEADER:
            raise Damage(f"overflow page {first} is past the end of data.mdb")
        stored, flags, _lower, _upper = PAGE.unpack(head)
        (run,) = layout.OVERFLOW_PAGES.unpack_from(head, 12)
        if stored != first or not flags & layout.P_OVERFLOW or run < pages:
            raise Damage(f"{where} node {slot}: overflow page {first} (number {stored}, "
                         f"flags {flags:#x}, {run} pages) does not hold a {size}-byte value")
        if not read:
            return None
        return os.pread(self.fd, PAGE_HEADER + size, first * self.psize)[PAGE_HEADER:]

    def free_list(self, where: str, slot: int, value: bytes | None) -> None:
        """A free-page list: a count, then that many page numbers in use."""
        if value is None or len(value) < 8 or len(value) % 8:
            raise Damage(f"{where} node {slot}: a free-page list of the wrong size")
        count = layout.TXNID.unpack_from(value)[0]
        if count * 8 + 8 > len(value):
            raise Damage(f"{where} node {slot}: a free-page list of {count} pages in "
                         f"{len(value)} bytes")
        if count and not all(2 <= pgno <= self.last
                             for pgno in struct.unpack_from(f"<{count}Q", value, 8)):
            raise Damage(f"{where} node {slot}: a free page past the last page in use")
