"""``asynccache.Provider``: the public base class for a store written outside asynccache.

Why it is built this way: docs/design.md, "The provider base".
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qsl

from ..errors import ConfigError, InvalidURL, StoreError, StoreTimeout
from .api import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_BATCH,
    DEFAULT_TIMEOUT,
    ConsumerReads,
    SimpleStore,
)
from .credentials import mask_url, query_of

__all__ = ["GUARDED", "Provider"]

T = TypeVar("T")

#: The operations a subclass may define that the base bounds and translates.
GUARDED = ("get_many", "set_many", "delete_many", "ping", "add_many", "contains_many",
           "sizes_many", "server_info")
#: Exceptions that pass through the guard unchanged: store trouble already said in our
#: terms, settings the user must fix, and "this store has no such operation".
_PASS = (StoreError, ConfigError, NotImplementedError)
#: asyncio's timeout is the builtin one from 3.11 on, its own class before
_TIMEOUTS = (TimeoutError, asyncio.TimeoutError)
#: Options every provider takes (from the URL's query string too).
_COMMON = {"timeout": float, "connect_timeout": float, "max_batch": int}


class _Held:
    """This process' and loop's connection (a slot: ``None`` is a valid connection)."""

    __slots__ = ("conn",)

    def __init__(self, conn: Any) -> None:
        self.conn = conn


def _mask_password(url: str) -> str:
    return mask_url(url)  # as connect() finds the password: any character may be in it


class Provider(SimpleStore[_Held]):
    """Base class for third-party stores: subclass, implement, ``register_scheme``.

    Args:
        url: the URL the provider was built from (kept for ``repr`` and logs, with any
            password masked).
        timeout: seconds each operation may take.
        connect_timeout: seconds, yours to use when you open a connection.
        max_batch: how many keys the core puts in one ``get_many`` (it may still send
            fewer or more; chunk if you must).
    """

    scheme: ClassVar[str] = "provider"
    """The URL scheme, for messages; set it on your subclass."""

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        super().__init__(timeout=timeout, connect_timeout=connect_timeout, max_batch=max_batch)
        self.url = url if url is not None else f"{self.scheme}://"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in GUARDED:
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_asynccache_guarded", False):
                if not inspect.iscoroutinefunction(fn):
                    raise TypeError(f"{cls.__qualname__}.{name} must be an `async def`")
                setattr(cls, name, _guard(name, fn))
        scan = cls.__dict__.get("scan")
        if scan is not None and not getattr(scan, "_asynccache_guarded", False):
            if not inspect.isasyncgenfunction(scan):
                raise TypeError(f"{cls.__qualname__}.scan must be an async generator "
                                "(`async def` with `yield`)")
            cls.scan = _guard_scan(scan)  # type: ignore[method-assign]

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Provider:
        """The default factory for `asynccache.register_scheme()`: ``cls(url,
        **options)``, with the URL's query string as options (keywords win).

        ``timeout``, ``connect_timeout`` and ``max_batch`` are converted to numbers;
        other query options arrive as strings (convert them in your ``__init__``).

        Args:
            url: the URL given to `asynccache.connect()`.
            **options: the keyword options given to it.

        Raises:
            ConfigError: an option your ``__init__`` does not take (the message names it).
            InvalidURL: a numeric option in the query string is not a number.
        """
        query = query_of(url)
        merged: dict[str, Any] = {}
        for name, raw in parse_qsl(query, keep_blank_values=True):
            convert = _COMMON.get(name)
            try:
                merged[name] = convert(raw) if convert else raw
            except ValueError:
                raise InvalidURL(f"option {name}={raw!r} in {_mask_password(url)} is not a "
                                 "number") from None
        merged.update(options)
        try:
            inspect.signature(cls).bind(url, **merged)
        except TypeError as exc:
            raise ConfigError(f"{_mask_password(url)}: {exc} ({cls.__qualname__} does not "
                              "take that option)") from None
        return cls(url, **merged)

    # -- the connection -------------------------------------------------------------------
    def open_connection(self) -> Any:
        """Create this process' and event loop's connection; returned as
        `connection`. Called on first use, inside the running loop; no network
        round trips here (they would not be bounded): connect lazily, or in an
        operation. The default has no connection (``None``)."""
        return None

    def close_connection(self, conn: Any) -> Awaitable[None] | None:
        """Close what `open_connection()` returned (may be ``async def``). Called
        by `close()` in the loop that opened it; never in a forked child for its
        parent's connection."""
        return None

    @property
    def connection(self) -> Any:
        """This process' and running loop's connection, opened on first use."""
        try:
            return self._state().conn
        except RuntimeError as exc:
            if "no running event loop" not in str(exc):
                raise
            raise RuntimeError(
                f"{type(self).__qualname__}.connection is per event loop: use it inside the "
                "provider's async operations") from None

    def _open_state(self) -> _Held:
        return _Held(self.open_connection())

    async def _close_state(self, state: _Held) -> None:
        closing = self.close_connection(state.conn)
        if inspect.isawaitable(closing):
            await closing

    # -- description ------------------------------------------------------------------------
    @property
    def safe_url(self) -> str:
        """The URL with any password masked; override if yours holds other secrets."""
        return _mask_password(self.url)

    # -- optional hooks -----------------------------------------------------------------------
    def consumer_reads(self) -> ConsumerReads | None:
        """None: read-ahead goes through the event-loop thread (docs/providers.md, "The
        consumer-side fast path", says when to return connections instead)."""
        return None

    async def server_info(self) -> dict[str, Any]:
        """What the command line shows for ``asynccache ping``/``stats``: the base's
        fields and which provider class serves the scheme."""
        return {**await super().server_info(),
                "provider": f"{type(self).__module__}.{type(self).__qualname__}",
                "scheme": self.scheme}

    # contains_many() (reads the values) and scan() (raises Unsupported: stats and flush
    # then say the store cannot list keys) are BaseClient's defaults: override them
    # when the store can do better.


# -- the guard ------------------------------------------------------------------------------
if sys.version_info >= (3, 11):
    async def _within(seconds: float, awaitable: Awaitable[T]) -> T:
        async with asyncio.timeout(seconds):  # no Task per call, unlike wait_for
            return await awaitable
else:  # pragma: no cover
    async def _within(seconds: float, awaitable: Awaitable[T]) -> T:
        return await asyncio.wait_for(awaitable, seconds)


def _timed_out(self: Provider, name: str) -> StoreTimeout:
    return StoreTimeout(
        f"{self.scheme} store did not answer {name} within {self.timeout:g}s "
        f"({self.safe_url}); raise `timeout=` in connect() if the store is just slow")


def _translated(self: Provider, name: str, exc: BaseException) -> StoreError:
    error = StoreError(f"{self.safe_url}: {type(self).__qualname__}.{name} raised "
                       f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _values_reply(self: Provider, name: str, asked: Any, reply: Any) -> list[Any]:
    """``get_many``'s reply checked: one ``bytes`` (or ``None``) per key asked, in order.

    Anything else is a StoreError: a value per position is what maps values to keys,
    so a reply one short (or long) would shift every value after it onto another key's
    position (or an index past the end), and a value that is not bytes is not one the
    codec can tell apart from damage."""
    values = _one_per_key(self, name, asked, reply, list, "values",
                          "one per key, in order, None where absent")
    for i, value in enumerate(values):
        if value is None or type(value) is bytes:
            continue
        if isinstance(value, bytes | bytearray | memoryview):
            values[i] = bytes(value)
            continue
        raise StoreError(f"{self.safe_url}: {type(self).__qualname__}.{name} returned a "
                         f"value of type {type(value).__name__}; values are bytes (or None "
                         "where absent)")
    return values


def _flags_reply(self: Provider, name: str, asked: Any, reply: Any) -> list[bool]:
    """``contains_many``'s / ``add_many``'s reply checked: one truth value per key."""
    return _one_per_key(self, name, asked, reply, lambda r: [bool(flag) for flag in r],
                        "answers", "one per key, in order")


def _sizes_reply(self: Provider, name: str, asked: Any, reply: Any) -> list[int | None]:
    """``sizes_many``'s reply checked: one size (an int >= 0) or None per key."""
    sizes = _one_per_key(self, name, asked, reply, list, "sizes",
                         "one per key, in order, None where absent")
    for size in sizes:
        if size is not None and (type(size) is not int or size < 0):
            raise StoreError(f"{self.safe_url}: {type(self).__qualname__}.{name} returned "
                             f"{size!r}; a size is an int >= 0 (or None where absent)")
    return [size or None for size in sizes]


def _one_per_key(self: Provider, name: str, asked: Any, reply: Any,
                 convert: Callable[[Any], list[Any]], what: str, rule: str) -> list[Any]:
    """``convert(reply)``, as many as keys were asked, or a StoreError saying ``rule``."""
    try:
        answers = convert(reply)
        expected = len(asked)
    except TypeError:
        raise StoreError(f"{self.safe_url}: {type(self).__qualname__}.{name} returned "
                         f"{type(reply).__name__}, not a list of {what}") from None
    if len(answers) != expected:
        raise StoreError(f"{self.safe_url}: {type(self).__qualname__}.{name} returned "
                         f"{len(answers)} {what} for {expected} keys (it must return {rule})")
    return answers


#: operations whose reply is one answer per key of their first argument
_REPLY_CHECKS = {"get_many": _values_reply, "contains_many": _flags_reply,
                 "add_many": _flags_reply, "sizes_many": _sizes_reply}


def _guard(name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    check = _REPLY_CHECKS.get(name)

    @functools.wraps(fn)
    async def guarded(self: Provider, *args: Any, **kwargs: Any) -> Any:
        try:
            reply = await _within(self.timeout, fn(self, *args, **kwargs))
        except _PASS:
            raise
        except _TIMEOUTS as exc:  # ours (asyncio.timeout) or the provider's own
            raise _timed_out(self, name) from exc
        except Exception as exc:
            raise _translated(self, name, exc) from exc
        except (KeyboardInterrupt, SystemExit) as exc:
            # Raised by the provider's own code: on asynccache's loop thread it would end
            # the loop (and with it every pipe of the process). A real Ctrl-C is delivered
            # to the main thread, which is where it is let through.
            if threading.current_thread() is threading.main_thread():
                raise
            raise _translated(self, name, exc) from exc
        if check is None:
            return reply
        asked = args[0] if args else next(iter(kwargs.values()), ())
        return check(self, name, asked, reply)

    guarded._asynccache_guarded = True  # type: ignore[attr-defined]
    return guarded


def _scan_page(self: Provider, prefix: bytes, page: Any) -> list[tuple[bytes, int | None]]:
    """A page of ``scan(prefix)`` checked: (key, size) pairs, every key under ``prefix``.

    ``asynccache flush`` deletes what scan lists: a provider listing keys outside the
    prefix (a filter forgotten) would have it delete other namespaces' keys, or other
    applications'. So such a page is a StoreError, and nothing of it is deleted."""
    try:
        pairs = [(bytes(key), size) for key, size in page]
    except (TypeError, ValueError):
        raise StoreError(f"{self.safe_url}: {type(self).__qualname__}.scan yielded "
                         f"{type(page).__name__}, not a list of (key, size) pairs") from None
    for key, _size in pairs:
        if not key.startswith(prefix):
            raise StoreError(f"{self.safe_url}: {type(self).__qualname__}.scan({prefix!r}) "
                             f"listed {key!r:.80}, which is not under that prefix; nothing "
                             "of that page is used (fix the provider's scan: it must only "
                             "list keys that start with the prefix)")
    return pairs


def _guard_scan(fn: Callable[..., AsyncGenerator[Any, None]]
                ) -> Callable[..., AsyncGenerator[Any, None]]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    async def guarded(self: Provider, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        prefix = bytes(signature.bind(self, *args, **kwargs).arguments["prefix"])
        inner = fn(self, *args, **kwargs)
        try:
            while True:
                try:
                    item = await _within(self.timeout, inner.__anext__())
                except StopAsyncIteration:
                    return
                except _PASS:
                    raise
                except _TIMEOUTS as exc:
                    raise _timed_out(self, "scan") from exc
                except Exception as exc:
                    raise _translated(self, "scan", exc) from exc
                yield _scan_page(self, prefix, item)
        finally:
            await inner.aclose()

    guarded._asynccache_guarded = True  # type: ignore[attr-defined]
    return guarded
