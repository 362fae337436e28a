"""URL schemes of third-party stores: ``register_scheme`` and the ``asynccache.stores``
entry points.

Why it is built this way: docs/design.md, "Third-party schemes".
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any

from ..errors import ConfigError

__all__ = [
    "BUILTIN_SCHEMES",
    "ENTRY_POINT_GROUP",
    "Factory",
    "describe",
    "known_schemes",
    "lookup",
    "register_scheme",
    "unregister_scheme",
]

logger = logging.getLogger("asynccache")

ENTRY_POINT_GROUP = "asynccache.stores"
BUILTIN_SCHEMES = frozenset({"redis", "rediss", "unix", "redis+cluster", "rediss+cluster",
                             "valkey", "valkeys", "valkey+cluster", "valkeys+cluster",
                             "memcached", "memory", "lmdb"})
Factory = Callable[..., Any]

_SCHEME = re.compile(r"[a-z][a-z0-9+.\-]*")
_lock = threading.Lock()
_registered: dict[str, Factory] = {}
#: scheme -> its entry points (several: a conflict), read once, on first need
_entry_points: dict[str, list[metadata.EntryPoint]] | None = None
_loaded: dict[str, Factory] = {}


def _checked(scheme: object) -> str:
    if not isinstance(scheme, str):
        raise ConfigError(f"a URL scheme is a str, got {type(scheme).__name__}")
    name = scheme.lower()
    if not _SCHEME.fullmatch(name):
        raise ConfigError(
            f"{scheme!r} is not a URL scheme: it must start with a letter and contain only "
            "letters, digits, '+', '-' and '.' (e.g. 'sqlite' or 'mystore+tls')")
    return name


def register_scheme(scheme: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``connect("scheme://...", **options)`` call ``factory(url, **options)``.

    Args:
        scheme: the URL scheme (a letter, then letters, digits, ``+``, ``-``, ``.``).
        factory: ``factory(url, **options)`` returns the client, e.g. a
            `Provider` subclass's ``from_url``.
        replace: take over a scheme that is already known (built-in or registered
            earlier in this process).

    Raises:
        ConfigError: the scheme is not a URL scheme, the factory is not callable, or the
            scheme is taken and ``replace`` is not given.
    """
    name = _checked(scheme)
    if not callable(factory):
        raise ConfigError(f"register_scheme({name!r}, ...): the factory must be callable "
                          f"(factory(url, **options) -> client), got {type(factory).__name__}")
    with _lock:
        if not replace and (name in _registered or name in BUILTIN_SCHEMES):
            what = "a built-in scheme" if name in BUILTIN_SCHEMES else (
                f"already registered to {describe(_registered[name])}")
            raise ConfigError(f"{name!r} is {what}; pass replace=True to take it over, or "
                              "register your store under a scheme of its own")
        _registered[name] = factory


def unregister_scheme(scheme: str) -> None:
    """Forget a scheme registered with `register_scheme()` (built-ins come back)."""
    with _lock:
        _registered.pop(_checked(scheme), None)


def lookup(scheme: str) -> Factory | None:
    """The factory for ``scheme``, or None when it is a built-in nobody replaced.

    Raises ``ConfigError`` for an unusable entry point; returns None for an unknown
    scheme too (``connect`` then lists what is known).
    """
    name = scheme.lower()
    with _lock:
        factory = _registered.get(name)
    if factory is not None or name in BUILTIN_SCHEMES:
        return factory
    return _from_entry_point(name)


def known_schemes() -> list[str]:
    """Every scheme ``connect`` accepts in this process, sorted (entry points read)."""
    with _lock:
        names = set(_registered) | BUILTIN_SCHEMES
    return sorted(names | set(_scan()))


# -- entry points ---------------------------------------------------------------------------
def _scan() -> dict[str, list[metadata.EntryPoint]]:
    global _entry_points
    with _lock:
        if _entry_points is not None:
            return _entry_points
    found: dict[str, list[metadata.EntryPoint]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            name = _checked(ep.name)
        except ConfigError as exc:
            logger.warning("asynccache: ignoring the %s entry point of %s: %s",
                           ENTRY_POINT_GROUP, _dist(ep), exc)
            continue
        if name in BUILTIN_SCHEMES:
            logger.warning("asynccache: ignoring the %s entry point %r of %s: %r is a "
                           "built-in scheme (use register_scheme(..., replace=True) to "
                           "replace it on purpose)", ENTRY_POINT_GROUP, ep.value, _dist(ep),
                           name)
            continue
        # the same distribution found twice on sys.path is one offer, not a conflict
        same = [other for other in found.get(name, []) if other.value == ep.value
                and _dist(other) == _dist(ep)]
        if not same:
            found.setdefault(name, []).append(ep)
    with _lock:
        if _entry_points is None:
            _entry_points = found
        return _entry_points


def _from_entry_point(name: str) -> Factory | None:
    with _lock:
        factory = _loaded.get(name)
    if factory is not None:
        return factory
    offers = _scan().get(name)
    if not offers:
        return None
    if len(offers) > 1:
        listed = "; ".join(f"{_dist(ep)} ({ep.value})" for ep in offers)
        raise ConfigError(
            f"several installed packages offer the URL scheme {name!r} ({ENTRY_POINT_GROUP} "
            f"entry points): {listed}. Uninstall one, or choose with "
            f"asynccache.register_scheme({name!r}, factory)")
    (ep,) = offers
    try:
        loaded: object = ep.load()
    except Exception as exc:
        raise ConfigError(
            f"the URL scheme {name!r} comes from {_dist(ep)}, whose {ENTRY_POINT_GROUP} entry "
            f"point {ep.name} = {ep.value!r} cannot be loaded ({type(exc).__name__}: {exc}); "
            f"reinstall or upgrade {_dist_name(ep)}, or uninstall it") from exc
    if not callable(loaded):
        raise ConfigError(
            f"the URL scheme {name!r} comes from {_dist(ep)}, whose {ENTRY_POINT_GROUP} entry "
            f"point {ep.value!r} is a {type(loaded).__name__}, not a factory "
            f"(factory(url, **options) -> client); report it to {_dist_name(ep)}")
    with _lock:
        _loaded[name] = loaded
    return loaded


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return "an unknown distribution" if dist is None else str(dist.metadata["Name"])


def _dist(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "an unknown distribution"
    return f"the distribution {dist.metadata['Name']} {dist.version}"


def describe(factory: Factory) -> str:
    """``module.Class.method`` of a factory, for messages (a bound classmethod names the
    class it is bound to, not the base class that defines it)."""
    owner = getattr(factory, "__self__", None)
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{factory.__name__}"
    module = getattr(factory, "__module__", None) or "?"
    return f"{module}.{getattr(factory, '__qualname__', repr(factory))}"
