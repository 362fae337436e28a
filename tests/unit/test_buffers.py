"""Memory for large values received in place: the allocator primed so that a batch of
them is recycled from the heap, not faulted in again (`store/transport/buffers.py`)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from asynccache.store.transport import buffers

_BATCHES = r"""
import resource, sys
import numpy as np
from asynccache.store.transport.buffers import value_buffer

if sys.argv[1] == "value_buffer":
    alloc = value_buffer
else:  # what value_buffer did before: numpy.empty, glibc's defaults untouched
    alloc = lambda n: memoryview(np.empty(n, dtype=np.uint8))

size = int(sys.argv[2])

def batch():
    values = [alloc(size) for _ in range(32)]  # a batch of large values...
    for v in values:
        np.frombuffer(v, np.uint8)[::4096] = 1  # ...received: every page written
    del values  # ...and collated: all freed at once

for _ in range(3):
    batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    batch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(alloc: str, size: int) -> int:
    out = subprocess.run([sys.executable, "-c", _BATCHES, alloc, str(size)], capture_output=True,
                         text=True, check=True, timeout=120)
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                    reason="what it measures is glibc's dynamic mmap/trim thresholds")
@pytest.mark.parametrize("size", [100 << 10, 1 << 20], ids=["100KiB", "1MiB"])
def test_batches_of_large_values_are_not_faulted_in_again(size: int) -> None:
    """640 values in batches of 32: glibc's defaults give the freed heap back after
    each batch (100 KiB: trim threshold 128 KiB; 1 MiB: twice the largest block freed)
    and fault the pages in again; primed, the heap keeps them for the next batch."""
    values, pages = 640, size // 4096
    plain, primed = _faults("numpy", size), _faults("value_buffer", size)
    assert plain > values * pages // 4, plain  # the cost this guards against is there...
    assert primed < values, primed  # ...and gone: under one fault per value
    assert primed * 10 < plain


def test_value_buffers_are_writable_aligned_and_their_own() -> None:
    a, b = buffers.value_buffer(100 << 10), buffers.value_buffer(100 << 10)
    for v in (a, b):
        view = memoryview(v)
        assert not view.readonly and view.nbytes == 100 << 10
    memoryview(a)[:4] = b"abcd"
    memoryview(b)[:4] = b"wxyz"
    assert bytes(memoryview(a)[:4]) == b"abcd"


def test_prime_runs_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(buffers, "_primed_in", -1)
    real = buffers.prime
    monkeypatch.setattr(buffers, "prime", lambda: (calls.append(1), real()))
    for _ in range(3):
        buffers.value_buffer(1 << 16)
    assert calls == [1] and buffers._primed_in == os.getpid()
