"""``@cache.cached(ttl=..., key=...)``: cache what an async function returns.

The key of a call is the function's module and qualified name plus its arguments, bound
to its signature (positional or keyword, defaults applied, so ``f(1)``, ``f(x=1)`` and
``f(1, lang="en")`` with ``lang="en"`` the default are one key), under the documented
key encoding of `asynccache.cache.keys`. A first parameter named ``self`` or ``cls`` is
left out: the instances of a service class share entries. ``key=callable`` replaces
the rule: it gets the call's arguments and returns a key.

Concurrent calls with the same arguments compute once (the coalescing of
`AsyncKVCache.get_or_compute()`; with ``lease=`` on the cache,
once across processes too), and every caller gets an object of its own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import ConfigError
from .expiry import check_ttl
from .keys import encode_key
from .markers import MISSING

if TYPE_CHECKING:
    from .core import AsyncKVCache

__all__ = ["cached", "call_key"]

T = TypeVar("T")
_SKIPPED = ("self", "cls")


def call_key(fn: Callable[..., Any], signature: inspect.Signature, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The default key of ``fn(*args, **kwargs)`` (as the module docstring says)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    parts: list[Any] = [f"{fn.__module__}.{fn.__qualname__}"]
    for index, (name, value) in enumerate(bound.arguments.items()):
        kind = signature.parameters[name].kind
        if index == 0 and name in _SKIPPED:
            continue
        if kind is inspect.Parameter.VAR_POSITIONAL:
            parts.append(tuple(value))
        elif kind is inspect.Parameter.VAR_KEYWORD:
            parts.append(tuple(sorted(value.items())))
        else:
            parts.append(value)
    return tuple(parts)


def cached(cache: AsyncKVCache, fn: Callable[..., Any], ttl: Any,
           key: Callable[..., Any] | None) -> Callable[..., Awaitable[Any]]:
    """``fn`` wrapped: its results cached in ``cache`` (as the module docstring says). A
    plain function is wrapped too, and the wrapper is a coroutine function either way."""
    if not callable(fn):
        raise ConfigError(f"cached() decorates a function, got {type(fn).__name__}")
    if key is not None and not callable(key):
        raise ConfigError(f"key= must be a callable taking the call's arguments, got "
                          f"{type(key).__name__}")
    if ttl is not MISSING:
        check_ttl(ttl)
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        k = key(*args, **kwargs) if key is not None else call_key(fn, signature, args, kwargs)
        encode_key(k)  # a KeyEncodingError naming the argument, before any work
        return await cache.get_or_compute(k, functools.partial(fn, *args, **kwargs), ttl)

    wrapper.cache = cache  # type: ignore[attr-defined]
    return wrapper
