"""``import asynccache`` stays light: no torch, no numpy, no redis-py until used; the
functional ``async_kv_cache`` appears whichever of torch and asynccache comes first."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_asynccache_loads_neither_torch_nor_numpy_nor_redis_py() -> None:
    out = run("import sys, asynccache as ac; ac.connect('memory://x'); "
              "print(sorted(m for m in ('torch', 'numpy', 'redis') if m in sys.modules))")
    assert out == "[]"


@pytest.mark.parametrize("first", ["torch", "asynccache"])
def test_the_functional_is_there_in_either_import_order(first: str) -> None:
    second = "asynccache" if first == "torch" else "torch"
    out = run(f"import {first}, {second}\n"
              "import asynccache as ac\n"
              "from torch.utils.data.datapipes.map import SequenceWrapper\n"
              "dp = SequenceWrapper([5, 6]).async_kv_cache(ac.connect('memory://o'), "
              "namespace='o')\n"
              "print(type(dp).__name__, dp[1])")
    assert out == "AsyncKVCacheMapDataPipe 6"


def test_the_pipe_and_the_cluster_client_load_when_asked_for() -> None:
    out = run("import sys, asynccache as ac\n"
              "assert 'torch' not in sys.modules\n"
              "cls = ac.AsyncKVCacheMapDataPipe\n"
              "assert 'torch' in sys.modules and cls.__name__ == 'AsyncKVCacheMapDataPipe'\n"
              "c = ac.connect('redis+cluster://127.0.0.1:1')\n"
              "print(type(c) is ac.RedisClusterClient, 'redis' in sys.modules)")
    assert out == "True True"


def test_the_functional_follows_torchs_datapipe_docstring_convention() -> None:
    """What torch's own datapipe docstring test checks of every functional."""
    import pydoc

    import torch.utils.data.datapipes.map as map_pipes

    import asynccache as ac

    dp = map_pipes.SequenceWrapper([1])
    doc = pydoc.render_doc(dp.async_kv_cache)  # type: ignore[attr-defined]
    assert "(functional name: ``async_kv_cache``)" in doc
    assert "Args:" in doc and "Example:" in doc
    assert ac.AsyncKVCacheMapDataPipe.__doc__.splitlines()[0].startswith("Caches a map-style")


def test_the_docstring_example_runs() -> None:
    import doctest

    import asynccache.readahead.datapipe

    result = doctest.testmod(asynccache.readahead.datapipe, verbose=False)
    assert result.attempted >= 4 and result.failed == 0
