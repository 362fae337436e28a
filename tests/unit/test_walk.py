"""The walk of ``await cache.get(k)``: the modules a call passes through before the store
is called, traced. Control goes down the layers and never back to the cache's core:
core -> coalesce (the loop tick's gathered gets) -> reads -> the store. Leaf lookups on
the way (the key rule, the loop state, the failure policy) are calls that return at once,
not crossings."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest

import asynccache as ac
from asynccache.cache.core import AsyncKVCache

#: modules called for a lookup that returns at once (the settings: `SettingsView`'s
#: properties, as ``cache.keyspace``)
LEAVES = {"asynccache.cache.keys", "asynccache.cache.loops", "asynccache.cache.health",
          "asynccache.cache.settings",
          "asynccache.cache.markers", "asynccache.observe.stats",
          "asynccache.observe.histogram"}


async def walk(call: Any) -> list[str]:
    """The asynccache modules entered by ``await call()`` until the store's first call,
    consecutive repeats collapsed, the store's module last."""
    entered: list[str] = []

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("asynccache."):
            return
        if module.startswith("asynccache.store."):
            entered.append(module)
            sys.setprofile(None)
        elif not entered or entered[-1] != module:
            entered.append(module)

    sys.setprofile(profile)
    try:
        await call()
    finally:
        sys.setprofile(None)
    return entered


@pytest.mark.anyio
async def test_a_get_goes_down_without_coming_back_to_the_core() -> None:
    cache = AsyncKVCache(ac.connect("memory://walk"), "walk-v1")
    await cache.get(1)  # the loop's state exists: the walk is that of every later get
    entered = await walk(lambda: cache.get(2))
    assert entered[-1].startswith("asynccache.store."), entered
    crossings = [m for m in entered[:-1] if m not in LEAVES]
    collapsed = [m for i, m in enumerate(crossings) if i == 0 or crossings[i - 1] != m]
    assert collapsed == ["asynccache.cache.core", "asynccache.cache.coalesce",
                         "asynccache.cache.reads"], entered
