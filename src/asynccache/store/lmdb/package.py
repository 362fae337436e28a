"""The ``lmdb`` package, imported in one place, with the install hint when it is missing.

A directory named ``lmdb`` in the current directory (an ``lmdb://`` cache made there, a
checkout) imports as an empty namespace package when the real one is not installed:
``lmdb.open`` is then an AttributeError far from its cause. Both cases say what to do.
"""

from __future__ import annotations

from ...errors import MissingDependency

try:
    import lmdb
except ImportError as exc:  # pragma: no cover - the extra is installed in CI
    raise MissingDependency(
        "lmdb:// needs the lmdb package: pip install 'asynccache[lmdb]'") from exc

if not hasattr(lmdb, "open"):
    _where = ", ".join(getattr(lmdb, "__path__", [])) or getattr(lmdb, "__file__", "?")
    del lmdb  # not the package: a later import must look again
    import sys

    sys.modules.pop("lmdb", None)
    raise MissingDependency(
        f"lmdb:// needs the lmdb package, and `import lmdb` found {_where} instead (a "
        f"directory named lmdb on the path, e.g. in the current directory): pip install "
        f"'asynccache[lmdb]', or rename that directory")

__all__ = ["lmdb"]
