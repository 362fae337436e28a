"""The public contract of DESIGN.md section 2: names, signatures, registration."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
from torch.utils.data import MapDataPipe

import asynccache as ac


def test_all_names_exist() -> None:
    for name in ac.__all__:
        assert hasattr(ac, name), name
    for name in ("connect", "AsyncKVCache", "CacheError"):
        assert name in ac.__all__
    # loaded on first use (torch, redis-py): attributes, not star-imported
    for name in ("AsyncKVCacheMapDataPipe", "RedisClusterClient"):
        assert hasattr(ac, name) and name not in ac.__all__


def test_a_star_import_is_as_light_as_import_asynccache() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom asynccache import *\n"
         "print(sorted(m for m in ('torch', 'numpy', 'redis') if m in sys.modules))\n"
         "print(connect('memory://star'))"],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "[]"


def test_datapipe_signature_matches_the_contract() -> None:
    params = inspect.signature(ac.AsyncKVCacheMapDataPipe).parameters
    assert list(params)[:8] == ["source", "client", "prefetch", "namespace", "ttl", "codec",
                                "on_error", "order"]
    assert params["lease"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["lease"].default is None
    defaults = {name: p.default for name, p in params.items()}
    assert defaults["prefetch"] == 64 and defaults["on_error"] == "fallback"
    assert defaults["namespace"] is None and defaults["ttl"] is None
    assert defaults["codec"] is None and defaults["order"] is None


def test_cache_signature_matches_the_contract() -> None:
    signature = inspect.signature(ac.AsyncKVCache).parameters
    params = list(signature)
    assert params[:5] == ["client", "namespace", "ttl", "codec", "on_error"]
    assert signature["lease"].kind is inspect.Parameter.KEYWORD_ONLY
    for method in ("get", "get_many", "set", "set_many", "get_or_compute", "delete", "stats"):
        assert callable(getattr(ac.AsyncKVCache, method)), method


def test_functional_form_is_registered() -> None:
    assert "async_kv_cache" in MapDataPipe.functions


@pytest.mark.parametrize("error", [ac.InvalidURL, ac.KeyTooLong, ac.EncodeError,
                                   ac.DecodeError, ac.ValueTooLarge, ac.StoreTimeout,
                                   ac.StoreUnavailable, ac.LoopError])
def test_errors_share_one_root(error: type[Exception]) -> None:
    assert issubclass(error, ac.CacheError)


def test_import_without_torch() -> None:
    """`import asynccache` works where torch is not installed (torch import blocked)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import asynccache as ac\n"
        "dp = ac.AsyncKVCacheMapDataPipe([1, 2, 3], ac.connect('memory://'), namespace='n')\n"
        "assert [dp[i] for i in range(3)] == [1, 2, 3]\n"
        "dp.close()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_ttl_is_typed_as_what_it_takes() -> None:
    """``ttl`` takes seconds or a ``datetime.timedelta`` everywhere; the signatures (and so
    the reference) say so, not ``Any``."""
    from asynccache.nodes import CachedMapper

    for fn in (ac.AsyncKVCacheMapDataPipe, CachedMapper, ac.AsyncKVCache,
               ac.AsyncKVCache.set_many, ac.AsyncKVCache.set, ac.AsyncKVCache.get_or_compute,
               ac.AsyncKVCache.cached, ac.AsyncKVCache.cached_many):
        annotation = str(inspect.signature(fn).parameters["ttl"].annotation)
        assert "timedelta" in annotation and "float" in annotation, (fn, annotation)
