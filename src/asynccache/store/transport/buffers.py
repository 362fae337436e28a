"""Memory for large values received in place, and the allocator told what is coming.

Every value of 64 KiB or more that a consumer's connection receives gets memory of its
own (`value_buffer`): the arrays and tensors decoded from it are its views, so it cannot
come from a pool that is reused. It comes from ``malloc``, and glibc's defaults make
fresh memory expensive at these sizes: a block under 128 KiB is carved from the heap,
and freeing a batch of them hands the heap's top back to the kernel at once (trim
threshold 128 KiB), so the next batch page-faults every page in again. On a VM a fault
costs microseconds: for 100 KiB values, ~16 faults and half of all the CPU a warm read
costs (`bench/results/wire.md`).

glibc raises both thresholds by itself once the process frees a block it had mapped
(``mmap_threshold`` to its size, ``trim_threshold`` to twice that: "this process handles
blocks this large"), up to a block of 32 MiB. `prime()` shows it one such block of
`PRIME_BYTES` (30 MiB, just under that cap) before the first large value, so values of
64 KiB up to 30 MiB are served from the heap and up to 60 MiB freed at once (a batch of
32 values of 1 MiB) stay there for the next batch instead of being faulted in again. The
heap keeps no more than it grew to at its peak. Larger batches (32 values of 4 MiB) are
past what glibc adjusts by itself (``MALLOC_TRIM_THRESHOLD_`` set by the user reaches
them). Elsewhere (musl, macOS, or with ``M_MMAP_THRESHOLD`` set, which turns the
adjustment off) it costs one allocation of untouched memory.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PRIME_BYTES", "prime", "value_buffer"]

#: the block `prime()` allocates and frees: glibc then serves blocks up to this size from
#: the heap and keeps twice this much freed memory in it before trimming (glibc adjusts
#: for freed blocks of up to 32 MiB: DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
PRIME_BYTES = 30 << 20


def value_buffer(size: int) -> bytearray | memoryview:
    """Memory for one large value, received in place, not zeroed first (the socket
    overwrites all of it): ``numpy.empty`` when numpy is installed (``bytearray(n)``
    writes n zeros, a pass over memory as long as the copy from the kernel), else a
    bytearray. Either starts where its allocation starts (16-byte aligned)."""
    if _primed_in != os.getpid():
        prime()
    np = _numpy()
    if np is None:
        return bytearray(size)
    return memoryview(np.empty(size, dtype=np.uint8))


def prime() -> None:
    """Allocate and free one block of `PRIME_BYTES` (once per process: a fork inherits
    the allocator's state, a spawned process primes its own)."""
    global _primed_in
    _primed_in = os.getpid()
    np = _numpy()
    block: Any = bytearray(PRIME_BYTES) if np is None else np.empty(PRIME_BYTES, np.uint8)
    del block


def _numpy() -> Any:
    global _NP
    if _NP is False:
        try:
            import numpy
        except ImportError:
            _NP = None
        else:
            _NP = numpy
    return _NP


_NP: Any = False
_primed_in = -1  # the pid that primed the allocator
