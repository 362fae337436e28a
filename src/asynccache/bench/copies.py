"""Bytes copied per byte of value read or written: issue 41's slice 4 row.

A value of 1 MiB may be copied several times on its way from the socket to the array a
user gets (into a parser's buffer, into a ``bytes`` per reply, into the array's storage)
and on its way back (joined into one buffer, copied by a queue). Each copy is a pass over
memory as long as the kernel's own, so the count says how far a path is from the wire.

How it counts: a small shared library preloaded into a child process (``LD_PRELOAD``)
wraps ``memcpy``, ``memmove`` and ``mempcpy`` and adds up the bytes of every call of at
least 1 KiB (`SHIM_C`). That sees the copies of CPython (``bytes``, ``bytearray``,
slices, ``pickle``), numpy and hiredis, asynccache's included; it does not see the
kernel's (``recv``/``send``: one per byte each way, on top of the count) nor copy loops
that call no libc function (torch's own kernels; the paths measured here decode arrays
through numpy). The child (`copies_child`) uses only the public API, so the same file
measures an older release for a before/after.

Phases, per store (Redis and memcached), value kind (``bytes``, float32 arrays) and size
(100 KiB, 1 MiB; 64 MiB of values each): a cold pass of the pipe's ``__getitems__``
(compute and write back), a warm pass of ``dp[i]`` in order (read-ahead), and the async
API's ``set_many``/``get_many`` in batches of 32. Needs a C compiler (``cc``) and Linux;
without them the block says why it is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ._common import BenchError, Session, Store

__all__ = ["KINDS", "ROW_SIZE", "SHIM_C", "SIZES", "build_shim", "measure", "run"]

#: (value bytes, items) per mode (full, quick, smoke): 64 MiB of values per case in full
SIZES = (
    ((100 * 1024, 640), (1024 * 1024, 64)),
    ((100 * 1024, 320), (1024 * 1024, 32)),
    ((100 * 1024, 64), (1024 * 1024, 8)),
)
KINDS = ("bytes", "float32 array")
#: the size whose counts are rows of the goals summary (all are in the results)
ROW_SIZE = 1024 * 1024
#: copies shorter than this are not counted (headers, small objects: not the value's bytes)
MIN_COPY = 1024

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

static unsigned long long copied;
static void *(*real_memcpy)(void *, const void *, size_t);
static void *(*real_memmove)(void *, const void *, size_t);
static void *(*real_mempcpy)(void *, const void *, size_t);

static inline void count(size_t n) {
    if (n >= MIN_COPY) __atomic_add_fetch(&copied, n, __ATOMIC_RELAXED);
}
void *memcpy(void *d, const void *s, size_t n) {
    if (!real_memcpy) real_memcpy = dlsym(RTLD_NEXT, "memcpy");
    count(n);
    return real_memcpy(d, s, n);
}
void *memmove(void *d, const void *s, size_t n) {
    if (!real_memmove) real_memmove = dlsym(RTLD_NEXT, "memmove");
    count(n);
    return real_memmove(d, s, n);
}
void *mempcpy(void *d, const void *s, size_t n) {
    if (!real_mempcpy) real_mempcpy = dlsym(RTLD_NEXT, "mempcpy");
    count(n);
    return real_mempcpy(d, s, n);
}
void *__memcpy_chk(void *d, const void *s, size_t n, size_t room) { return memcpy(d, s, n); }
void *__memmove_chk(void *d, const void *s, size_t n, size_t room) { return memmove(d, s, n); }
unsigned long long copycount_bytes(void) { return __atomic_load_n(&copied, __ATOMIC_RELAXED); }
"""


def build_shim(directory: str) -> str | None:
    """The counter built in ``directory`` (its path), or None without a compiler/Linux."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        return None
    source = Path(directory, "copycount.c")
    source.write_text(SHIM_C)
    target = str(Path(directory, "copycount.so"))
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O2", f"-DMIN_COPY={MIN_COPY}",
                            "-o", target, str(source), "-ldl"],
                           capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise BenchError(f"building the copy counter failed: {built.stderr.strip()}")
    return target


def measure(shim: str, stores: dict[str, tuple[str, float | None]], sizes: Any, namespace: str,
            pythonpath: str | None = None) -> list[dict[str, Any]]:
    """Run the child with the counter preloaded (``stores``: name -> (URL, ttl);
    ``pythonpath``: the ``src`` of another
    release to measure instead of this one)."""
    env = {**os.environ, "LD_PRELOAD": shim, "ASYNCCACHE_COPYCOUNT": shim}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    config = {"stores": stores, "sizes": [list(x) for x in sizes], "kinds": list(KINDS),
              "namespace": namespace}
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("copies_child.py")),
                            json.dumps(config)], env=env, capture_output=True, text=True,
                           check=False, timeout=1800)
    if child.returncode != 0:
        raise BenchError(f"the copy count failed: {child.stderr.strip()[-2000:]}")
    results: list[dict[str, Any]] = json.loads(child.stdout.strip().splitlines()[-1])["results"]
    return results


def run(s: Session, redis_store: Store, memcached: Store | None) -> dict[str, Any]:
    """The counts of this release, per store, kind, size and phase."""
    with tempfile.TemporaryDirectory(prefix="asynccache-copies-") as tmp:
        shim = build_shim(tmp)
        if shim is None:
            return {"absent": "needs Linux and a C compiler (cc) to preload the counter"}
        stores = {"redis": (redis_store.url, s.ttl(redis_store))}
        if memcached is not None:
            stores["memcached"] = (memcached.url, s.ttl(memcached))
        results = measure(shim, stores, SIZES[s.mode_index], s.namespace("copies", "run"))
    return {"min_copy": MIN_COPY, "results": results}
