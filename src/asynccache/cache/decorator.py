"""``@cache.cached`` and ``@cache.cached_many``: cache what an async function returns.

The key of a call is the function's identity plus its arguments bound to its signature
(positional or keyword, defaults applied: ``f(1)``, ``f(x=1)`` and ``f(1, lang="en")``
with that default are one key), under the call-key encoding of `asynccache.cache.keys`
(exact over types; hashed when long). A method's instance joins the key through its
``__cache_key__()``, or only its class with ``noself=True``; a classmethod's ``cls`` by its
qualified name. ``key=callable`` replaces the rule. The full reference, and where it
differs from aiocache and cashews: docs/async-services.md.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import secrets
import types
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..errors import ConfigError, MethodKeyError
from .coalesce import Computed, SharedComputation
from .expiry import check_ttl
from .keys import call_store_key, encode_arg, type_name
from .markers import MISSING, Failed
from .reads import IMMUTABLE

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .codec import Codec
    from .keys import Keyspace
    from .loops import Loops, LoopState
    from .reads import ReadPath
    from .writes import Writer

__all__ = ["CallKey", "Condition", "DecoratedCache", "cached", "cached_many",
           "function_identity"]

#: ``condition(result) -> bool``: whether a computed result is stored
Condition = Callable[[Any], bool]


class DecoratedCache(Protocol):
    """What a decorated function uses of its cache (`AsyncKVCache`): named here, so that
    the decorators do not import the cache that offers them."""

    reads: ReadPath
    writer: Writer
    loops: Loops

    @property
    def keyspace(self) -> Keyspace: ...
    @property
    def codec(self) -> Codec: ...

    def key(self, key: Any) -> bytes: ...
    def resolve_ttl(self, ttl: Any) -> float | None: ...
    async def write_entries(self, entries: dict[bytes, bytes], ttl: Any = ...) -> bool: ...
    async def invalidate_store_keys(self, store_keys: Sequence[bytes]) -> None: ...
    async def compute_once(self, store_key: bytes, compute: Callable[[], Any],
                           ttl: float | None, condition: Condition | None = None) -> Any: ...

T = TypeVar("T")
#: First parameters that make a function a method: the instance or class joins the key.
_SELF = ("self", "cls")


def _code_digest(code: types.CodeType) -> bytes:
    """A digest of what a code object does (bytecode and constants, nested code too), the
    same in every process of one Python version: two lambdas on one line differ by it."""
    h = hashlib.blake2b(digest_size=8)

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            elif isinstance(const, frozenset):  # its repr's order depends on the str hash seed
                h.update(repr(sorted(map(repr, const))).encode())
            else:
                h.update(repr(const).encode())

    feed(code)
    return h.hexdigest().encode()


def _token() -> bytes:
    """A part no other function object has (this process only)."""
    return b"z" + secrets.token_hex(8).encode()


def _cell(cell: Any) -> bytes:
    """What a closure's captured variable adds to its function's identity: its value
    where the call-key encoding covers it (closures of one factory made with different
    values differ, in every process alike), a named function or module by its name, and
    anything else a token of this function object (never shared by mistake)."""
    try:
        value = cell.cell_contents
    except ValueError:  # not bound yet when decorated
        return _token()
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType) and \
            "<" not in value.__qualname__:
        return b"p" + encode_arg(f"{value.__module__}.{value.__qualname__}")
    if isinstance(value, types.ModuleType):
        return b"o" + encode_arg(value.__name__)
    try:
        return encode_arg(value)
    except ConfigError:  # not encodable (a client, a lock...): this object's own
        return _token()


def instance_part(obj: Any, noself: bool, where: str) -> bytes:
    """What a method's instance (or a classmethod's class) adds to a call's key."""
    if isinstance(obj, type):
        return b"c" + encode_arg(type_name(obj))
    kind = type(obj)
    if noself:
        return b"S" + encode_arg(type_name(kind))
    if getattr(kind, "__cache_key__", None) is not None:
        return encode_arg(obj, f"{where}'s instance")
    raise MethodKeyError(
        f"{where} is cached per instance, but {type_name(kind)} has no __cache_key__(): "
        f"give the class a __cache_key__(self) method returning what tells its instances "
        f"apart (e.g. return self.tenant), or decorate with cached(noself=True) if all "
        f"instances may share entries")


def function_identity(fn: Any, noself: bool) -> bytes:
    """What tells ``fn`` apart from every other function in a key (docs/formats.md,
    "Call keys"): its module and qualified name; for a lambda or a function defined in
    another (``<locals>``) also its first line, a digest of its code and its captured
    values; a partial by its function and bound arguments; a bound method or a callable
    instance by its instance as a method's."""
    if isinstance(fn, functools.partial):
        return (b"P" + function_identity(fn.func, noself)
                + encode_arg(fn.args, "a functools.partial's argument")
                + encode_arg(dict(fn.keywords), "a functools.partial's argument"))
    if inspect.ismethod(fn):
        where = f"{fn.__func__.__module__}.{fn.__func__.__qualname__}"
        return (b"M" + function_identity(fn.__func__, noself)
                + instance_part(fn.__self__, noself, where))
    if isinstance(fn, types.FunctionType | types.BuiltinFunctionType):
        name = f"{fn.__module__}.{fn.__qualname__}"
        code = getattr(fn, "__code__", None)
        if code is None or "<" not in fn.__qualname__:
            return b"F" + encode_arg(name)
        cells = getattr(fn, "__closure__", None) or ()
        return (b"L" + encode_arg(name) + b"%d;" % code.co_firstlineno + _code_digest(code)
                + b"%d:" % len(cells) + b"".join(_cell(c) for c in cells))
    kind = type(fn)  # a callable instance: its class's __call__, the instance as a method's
    return b"I" + encode_arg(type_name(kind)) + instance_part(fn, noself, type_name(kind))


class CallKey:
    """The store key of each call of one decorated function."""

    __slots__ = ("cache", "fn", "identity", "key", "method", "noself", "signature", "where")

    def __init__(self, cache: DecoratedCache, fn: Any, key: Callable[..., Any] | None,
                 noself: bool) -> None:
        self.cache = cache
        self.fn = fn
        self.key = key
        self.noself = noself
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cached() needs a function whose signature Python can read "
                              f"({exc}); wrap it in an async def") from exc
        params = list(self.signature.parameters)
        self.method = bool(params) and params[0] in _SELF
        self.where = getattr(fn, "__qualname__", type_name(type(fn)))
        self.identity = b"" if key is not None else function_identity(fn, noself)

    def body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        """The encoded call: identity, then every parameter's value in signature order
        (their number is fixed by the signature, so the concatenation is injective)."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        parts = [self.identity]
        params = self.signature.parameters
        for index, (name, value) in enumerate(bound.arguments.items()):
            kind = params[name].kind
            if index == 0 and self.method:
                parts.append(instance_part(value, self.noself, self.where))
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                parts.append(encode_arg(tuple(value), f"argument *{name}"))
            elif kind is inspect.Parameter.VAR_KEYWORD:
                parts.append(encode_arg(dict(value), f"argument **{name}"))
            else:
                parts.append(encode_arg(value, f"argument {name}="))
        return b"".join(parts)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        """The store key of ``fn(*args, **kwargs)``."""
        if self.key is not None:
            return self.cache.key(self.key(*args, **kwargs))
        return call_store_key(self.cache.keyspace, self.body(args, kwargs))


def _check(fn: Any, ttl: Any, key: Any, condition: Any = None) -> None:
    if not callable(fn):
        hint = (" (put @classmethod / @staticmethod above @cache.cached)"
                if isinstance(fn, classmethod | staticmethod) else "")
        raise ConfigError(f"cached() decorates a function, got {type(fn).__name__}{hint}")
    if key is not None and not callable(key):
        raise ConfigError(f"key= must be a callable taking the call's arguments, got "
                          f"{type(key).__name__}")
    if condition is not None and not callable(condition):
        raise ConfigError(f"condition= must be a callable taking a result and returning "
                          f"whether to store it, got {type(condition).__name__}")
    if ttl is not MISSING:
        check_ttl(ttl)


def cached(cache: DecoratedCache, fn: Any, ttl: Any, key: Callable[..., Any] | None,
           noself: bool = False, condition: Condition | None = None
           ) -> Callable[..., Awaitable[Any]]:
    """``fn`` wrapped: its results cached in ``cache`` (as the module docstring says). A
    plain function is wrapped too, and the wrapper is a coroutine function either way,
    with ``key()`` and ``invalidate()`` for one call's entry."""
    _check(fn, ttl, key, condition)
    call_key = CallKey(cache, fn, key, noself)
    resolved = cache.resolve_ttl(ttl)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        store_key = call_key(args, kwargs)  # a KeyEncodingError before any work
        return await cache.compute_once(store_key, functools.partial(fn, *args, **kwargs),
                                        resolved, condition)

    async def invalidate(*args: Any, **kwargs: Any) -> None:
        """Delete the entry of ``fn(*args, **kwargs)`` (near tier and this process's
        records too): the next call computes it again."""
        await cache.invalidate_store_keys([call_key(args, kwargs)])

    _decorate(wrapper, fn)
    wrapper.cache = cache  # type: ignore[attr-defined]
    wrapper.key = lambda *args, **kwargs: call_key(args, kwargs)  # type: ignore[attr-defined]
    wrapper.invalidate = invalidate  # type: ignore[attr-defined]
    return wrapper


def _decorate(wrapper: Callable[..., Any], fn: Any) -> None:
    """functools.wraps for functions, partials and callable instances alike."""
    functools.update_wrapper(wrapper, fn)
    if not hasattr(fn, "__name__"):
        inner = getattr(fn, "func", type(fn))
        wrapper.__name__ = getattr(inner, "__name__", type(fn).__name__)
        wrapper.__qualname__ = getattr(inner, "__qualname__", wrapper.__name__)


def cached_many(cache: DecoratedCache, fn: Any, ttl: Any, key: Callable[..., Any] | None,
                noself: bool = False) -> Callable[..., Awaitable[dict[Any, Any]]]:
    """``fn(ids, *rest) -> {id: value}`` wrapped (see `AsyncKVCache.cached_many()`).

    An id's key is that of a call of ``fn`` with the single id in place of the list
    (``key(id, *rest, **kwargs)`` with ``key=``), so it is exact over types like any call."""
    _check(fn, ttl, key)
    call_key = CallKey(cache, fn, key, noself)
    resolved = cache.resolve_ttl(ttl)
    ids_at = 1 if call_key.method else 0

    ids_name = list(call_key.signature.parameters)[ids_at:ids_at + 1]

    def keys_of(args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[list[Any], dict[Any, bytes], tuple[Any, ...], dict[str, Any]]:
        """The call's ids (duplicates once, in order), each one's store key, and the
        arguments with the ids positional."""
        if len(args) <= ids_at and ids_name and ids_name[0] in kwargs:  # ids by keyword
            kwargs = dict(kwargs)
            args = (*args, kwargs.pop(ids_name[0]))
        if len(args) <= ids_at:
            raise ConfigError(f"{call_key.where}: a cached_many function takes the ids as its "
                              f"first argument, got none")
        ids = list(dict.fromkeys(args[ids_at]))
        head, rest = args[:ids_at], args[ids_at + 1:]
        if key is not None:
            keys = {i: cache.key(key(*head, i, *rest, **kwargs)) for i in ids}
        else:
            keys = {i: call_store_key(cache.keyspace, call_key.body((*head, i, *rest), kwargs))
                    for i in ids}
        return ids, keys, args, kwargs

    async def wrapper(*args: Any, **kwargs: Any) -> dict[Any, Any]:
        ids, store_keys, args, kwargs = keys_of(args, kwargs)
        if not ids:
            return {}
        here = cache.loops.here()
        joined = {i: here.computing[sk] for i, sk in store_keys.items() if sk in here.computing}
        asked = [i for i in ids if i not in joined]
        out: dict[Any, Any] = {}
        if asked:
            mark = here.finishes
            here.readers += 1
            try:
                values = await cache.reads.read([store_keys[i] for i in asked])
                missing = []
                for i, value in zip(asked, values):
                    if type(value) is Failed:
                        raise value.error
                    if value is not MISSING:
                        out[i] = value
                        continue
                    shared = (here.computing.get(store_keys[i])
                              or here.finished_since(store_keys[i], mark))
                    if shared is not None:
                        joined[i] = shared
                    else:
                        missing.append(i)
            finally:
                here.readers -= 1
                if not here.readers:
                    here.finished.clear()
            if missing:
                _compute_batch(cache, here, fn, args, kwargs, ids_at, missing, store_keys,
                               resolved, joined)
        for i, shared in joined.items():
            value = await shared.result(cache.codec.decode)
            if value is not MISSING:
                out[i] = value
        return {i: out[i] for i in ids if i in out}

    async def invalidate(*args: Any, **kwargs: Any) -> None:
        """Delete the entries of these ids (near tier and this process's records too)."""
        store_keys = keys_of(args, kwargs)[1]
        await cache.invalidate_store_keys(list(store_keys.values()))

    def keys(*args: Any, **kwargs: Any) -> dict[Any, bytes]:
        """``{id: store key}`` of a call's ids."""
        return keys_of(args, kwargs)[1]

    _decorate(wrapper, fn)
    wrapper.cache = cache  # type: ignore[attr-defined]
    wrapper.key = keys  # type: ignore[attr-defined]
    wrapper.invalidate = invalidate  # type: ignore[attr-defined]
    return wrapper


def _compute_batch(cache: DecoratedCache, here: LoopState, fn: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any], ids_at: int, missing: list[Any],
                   store_keys: dict[Any, bytes], ttl: float | None,
                   joined: dict[Any, SharedComputation]) -> None:
    """Start one computation of ``fn`` for the ``missing`` ids and register it as each id's
    computation (concurrent calls join it per id)."""
    wanted = {store_keys[i]: i for i in missing}

    async def compute() -> dict[bytes, Computed]:
        call_args = (*args[:ids_at], list(missing), *args[ids_at + 1:])
        result = fn(*call_args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        if not isinstance(result, dict):
            raise ConfigError(f"a cached_many function returns {{id: value}}, got "
                              f"{type(result).__name__}")
        found = {sk: result[i] for sk, i in wanted.items() if i in result}
        if not found:
            return {}
        blobs = cache.writer.encode_values(found)
        await cache.write_entries(cache.writer.entries_for(blobs), ttl)
        return {sk: Computed(v, None if type(v) in IMMUTABLE else blobs[sk])
                for sk, v in found.items()}

    task = here.loop.create_task(compute())
    for i in missing:
        sk = store_keys[i]
        shared = here.computing[sk] = joined[i] = SharedComputation(task, sk, batch=True)
        task.add_done_callback(functools.partial(here.done, sk, shared))
