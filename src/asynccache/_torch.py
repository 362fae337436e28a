"""torch only when used: the functional ``async_kv_cache`` appears when torch does.

``import asynccache`` imports neither torch nor numpy (torch costs ~2 s, 200 MiB and a
GC heap that an async service pays in its tail latency). The PyTorch integration loads
when it is first needed: ``ac.AsyncKVCacheMapDataPipe`` through the package's
``__getattr__``, and the functional form ``MapDataPipe.async_kv_cache`` as soon as both
packages are imported, in either order:

* torch first: registered when asynccache is imported;
* asynccache first: registered right after ``torch`` finishes importing, by a
  post-import hook (a ``sys.meta_path`` finder that wraps the ``exec_module`` of
  torch's own loader and removes itself once it fired, in the manner of
  ``wrapt.register_post_import_hook``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]

logger = logging.getLogger("asynccache")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders return for ``name``."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or getattr(self._local, "busy", False):
            return None
        self._local.busy = True  # the lookup below asks every finder, this one too
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._local.busy = False
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module
        finder = self

        def exec_module(module: ModuleType) -> None:
            original(module)
            finder.fire()

        loader.exec_module = exec_module  # this module's loader object only
        return spec

    def fire(self) -> None:
        """Run the callback once and leave ``sys.meta_path``."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            self.callback()
        except Exception:  # never break the user's import of torch
            logger.warning("asynccache: setting up the PyTorch integration failed; "
                           "use ac.AsyncKVCacheMapDataPipe(...) directly", exc_info=True)


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once module ``name`` is imported: now if it already is, else
    right after its import completes (top-level modules)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing",
                                      False) is False:
        callback()
        return
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


def register_functional() -> None:
    """Import the pipe, which registers ``MapDataPipe.async_kv_cache``."""
    importlib.import_module("asynccache.readahead.datapipe")
