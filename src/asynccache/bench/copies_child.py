"""The process `asynccache.bench.copies` measures in: run as a script, with the copy counter
preloaded (``LD_PRELOAD``), one JSON object on stdout.

It uses only the public API (``connect``, ``AsyncKVCacheMapDataPipe``, ``AsyncKVCache``),
so the same file measures an older release too (``PYTHONPATH`` at its ``src``): the
"before" of a change. Every value is built before the counting starts, and each phase
counts from its first call to the end of its writes (``close()`` waits for them).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import sys
from typing import Any

import numpy as np

import asynccache as ac

#: batch of the pipe's ``__getitems__`` and of the async ``get_many``/``set_many``
BATCH = 32


def _counter() -> Any:
    lib = ctypes.CDLL(os.environ["ASYNCCACHE_COPYCOUNT"])
    lib.copycount_bytes.restype = ctypes.c_ulonglong
    return lib.copycount_bytes


def _values(kind: str, n: int, size: int) -> list[Any]:
    if kind == "bytes":
        return [np.full(size, i % 251, np.uint8).tobytes() for i in range(n)]
    return [np.full(size // 4, i % 251, np.float32) for i in range(n)]


class _Source:
    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> Any:
        return self.values[index]


def _same(a: Any, b: Any) -> bool:
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b


def _pipe_phases(url: str, ttl: float | None, namespace: str, values: list[Any], copied: Any
                 ) -> dict[str, int]:
    """Cold: ``__getitems__`` of every batch computes and writes back; warm: ``dp[i]`` in
    order (read-ahead) from a fresh pipe."""
    out: dict[str, int] = {}
    n = len(values)
    before = copied()
    with ac.AsyncKVCacheMapDataPipe(_Source(values), ac.connect(url, timeout=10),
                                    namespace=namespace, ttl=ttl) as dp:
        for start in range(0, n, BATCH):
            dp.__getitems__(list(range(start, min(n, start + BATCH))))
    out["pipe write"] = copied() - before
    pipe = ac.AsyncKVCacheMapDataPipe(_Source(values), ac.connect(url, timeout=10),
                                      namespace=namespace, ttl=ttl)
    before = copied()
    with pipe:
        got = [pipe[i] for i in range(n)]
        computed = pipe.stats()["computed"]
    out["pipe read"] = copied() - before
    if computed or not all(_same(a, b) for a, b in zip(got, values, strict=True)):
        raise SystemExit(f"the warm pass computed {computed} items or read a wrong value")
    return out


async def _cache_phases(url: str, ttl: float | None, namespace: str, values: list[Any],
                        copied: Any) -> dict[str, int]:
    """``set_many`` then ``get_many`` in batches, on the asyncio path."""
    out: dict[str, int] = {}
    keys = [f"k{i}" for i in range(len(values))]
    async with ac.AsyncKVCache(ac.connect(url, timeout=10), namespace=namespace,
                                 ttl=ttl) as cache:
        before = copied()
        for start in range(0, len(keys), BATCH):
            await cache.set_many({k: values[i] for i, k in
                                  enumerate(keys[start:start + BATCH], start)})
        out["set_many"] = copied() - before
        before = copied()
        got: dict[str, Any] = {}
        for start in range(0, len(keys), BATCH):
            got.update(await cache.get_many(keys[start:start + BATCH]))
        out["get_many"] = copied() - before
    if len(got) != len(keys) or not all(_same(got[k], values[i]) for i, k in enumerate(keys)):
        raise SystemExit("get_many missed or read a wrong value")
    return out


def main(config: dict[str, Any]) -> dict[str, Any]:
    copied = _counter()
    results = []
    for store, (url, ttl) in config["stores"].items():
        for size, n in config["sizes"]:
            for kind in config["kinds"]:
                values = _values(kind, n, size)
                value_bytes = n * size
                ns = f"{config['namespace']}-{store}-{kind}-{size}"
                counts = _pipe_phases(url, ttl, ns + "-pipe", values, copied)
                counts.update(asyncio.run(_cache_phases(url, ttl, ns + "-cache", values, copied)))
                results.append({
                    "store": store, "kind": kind, "value_bytes": size, "items": n,
                    "copied": counts,
                    "per_byte": {phase: c / value_bytes for phase, c in counts.items()},
                })
    return {"results": results}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
