"""User keys and dataset indices → store keys: one documented, injective encoding.

Store key = ``b"ac:" + namespace + b":" + encode_key(key)``: an int (anything
``operator.index()`` accepts) in decimal, ``s:`` + UTF-8 for str, ``b:`` + bytes, ``n:``
for None, ``t:`` + length-prefixed elements for a tuple; anything else is a
``KeyEncodingError``. A chunk (``c:``) and a lease (``l:``) sit under the same prefix with
tags no encoded key starts with. Without ``namespace=`` an object gets an ``anon-`` one
of its own. The full rule and why it is injective: docs/design.md, "Keys".

The decorator's call keys have an encoding of their own (`encode_arg()`, under the ``f1:``
tag): exact over types and wider, while index keys stay byte for byte what they were
(docs/formats.md, "Call keys").
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import hashlib
import logging
import operator
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..errors import ConfigError, KeyEncodingError, KeyTooLong

__all__ = [
    "ANON_PREFIX",
    "ANON_TTL",
    "CALL_TAG",
    "MAX_NAMESPACE_BYTES",
    "Keyspace",
    "call_store_key",
    "check_namespace",
    "chunk_keys",
    "encode_arg",
    "encode_key",
    "lease_key",
    "namespace_prefix",
    "type_name",
    "unique_namespace",
    "unnamed",
    "unnamed_since",
]

MAX_NAMESPACE_BYTES = 200
#: What a namespace made for an object built without ``namespace=`` starts with.
ANON_PREFIX = "anon-"
#: Seconds the values of such a namespace live when no ``ttl=`` is given: nobody can
#: reuse them after the run, so they must not stay in a shared store forever.
ANON_TTL = 24 * 3600.0
#: The largest store key (namespace prefix + encoded key) by default, in bytes.
DEFAULT_MAX_KEY_SIZE = 1024

logger = logging.getLogger("asynccache")
_announced = threading.Event()


def encode_key(key: Any) -> bytes:
    """``key`` → bytes by the rule above (in full: docs/design.md, "Keys")."""
    if type(key) is int:  # the hot case first
        return b"%d" % key
    if isinstance(key, str):
        return b"s:" + key.encode("utf-8", "surrogatepass")
    if isinstance(key, bytes | bytearray | memoryview):
        return b"b:" + bytes(key)
    if key is None:
        return b"n:"
    if isinstance(key, tuple):
        parts = [b"t:"]
        for element in key:
            encoded = encode_key(element)
            parts.append(b"%d:" % len(encoded))
            parts.append(encoded)
        return b"".join(parts)
    try:
        return b"%d" % operator.index(key)
    except TypeError:
        pass
    raise KeyEncodingError(
        f"cannot use a {type(key).__name__} ({key!r:.60}) as a cache key: keys are ints "
        "(numpy / torch integers too), str, bytes, or tuples of them; convert it to one of "
        "those (for a float or an object, a stable id of your own)"
    )


def check_namespace(namespace: str) -> str:
    """A valid namespace: a non-empty str of at most MAX_NAMESPACE_BYTES UTF-8 bytes."""
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"namespace must be a non-empty str, got {namespace!r}")
    if ":" in namespace:
        # ':' separates the parts of a store key: namespace "a:s" with key 1 and namespace
        # "a" with key "1" would both be b"ac:a:s:1"
        raise ConfigError(f"namespace {namespace!r} contains ':', which separates the parts "
                          "of store keys; use '-', '.' or '/' instead (e.g. 'imagenet-v3')")
    size = len(namespace.encode())
    if size > MAX_NAMESPACE_BYTES:
        raise KeyTooLong(
            f"namespace {namespace[:40]!r}... is {size} bytes; keep it under "
            f"{MAX_NAMESPACE_BYTES} (use a short name plus a version, e.g. 'imagenet-v3')"
        )
    return namespace


def namespace_prefix(namespace: str) -> bytes:
    """``b"ac:" + namespace + b":"``: what every store key of the namespace starts with."""
    return b"ac:" + namespace.encode() + b":"


def _split(store_key: bytes) -> tuple[bytes, bytes]:
    """(namespace prefix, encoded key) of a value's store key."""
    head, sep, rest = store_key.partition(b":")
    namespace, sep2, encoded = rest.partition(b":")
    if not (head == b"ac" and sep and sep2):
        raise ValueError(f"not an asynccache value key: {store_key!r}")
    return b"ac:" + namespace + b":", encoded


def chunk_keys(store_key: bytes, token: str, chunks: int) -> list[bytes]:
    """The keys of a chunked value's chunks (see docs/design.md, "Keys")."""
    prefix, encoded = _split(store_key)
    stem = prefix + b"c:" + token.encode() + b":"
    return [b"%b%d:%b" % (stem, i, encoded) for i in range(chunks)]


def lease_key(store_key: bytes) -> bytes:
    """The key of the lease on a value's store key (see docs/design.md, "Keys")."""
    prefix, encoded = _split(store_key)
    return prefix + b"l:" + encoded


class _Scope:
    """Unnamed objects built inside `anonymous_scope()`: the n-th one gets ``<base>-<n>``."""

    def __init__(self, base: str, quiet: bool) -> None:
        self.base, self.quiet, self.made = base, quiet, 0

    def next(self) -> str:
        self.made += 1
        return f"{self.base}-{self.made}"


_SCOPE: ContextVar[_Scope | None] = ContextVar("asynccache_anonymous_scope", default=None)


@contextmanager
def anonymous_scope(base: str, quiet: bool = False) -> Iterator[None]:
    """Inside, an object built without ``namespace=`` gets ``<base>-1``, ``<base>-2``, ...
    in the order they are built, instead of a namespace of its own.

    For an owner whose copies build objects anew (`asynccache.nodes.NodeIterable` builds
    each DataLoader worker's node, every epoch): ``base`` is the owner's own unique
    namespace, which its pickled copies share, so the n-th node every copy builds reads
    the values of the n-th node the others built (no epoch computes everything again),
    and no other owner's. ``quiet``: do not announce (the announcement is per process:
    once per worker per epoch would bury the log)."""
    token = _SCOPE.set(_Scope(base, quiet))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def unique_namespace() -> str:
    """A namespace no other object will ever use (see docs/design.md, "Keys"):
    ``anon-`` + the time it was made (Unix seconds, 8 hex digits) + ``-`` + 8 random hex
    digits. The time lets ``asynccache namespaces`` say how old it is, and ``asynccache
    flush --unnamed --older-than`` remove those nobody can be using any more."""
    return f"{ANON_PREFIX}{int(time.time()) & 0xFFFFFFFF:08x}-{secrets.token_hex(4)}"


_UNNAMED = re.compile(r"anon-([0-9a-f]{8})-[0-9a-f]{8}(?:-\d+)?")


def unnamed(namespace: str) -> bool:
    """Whether ``namespace`` is one an object drew without ``namespace=`` (this release's
    form or an older one's: ``anon-`` + 16 hex digits)."""
    return namespace.startswith(ANON_PREFIX)


def unnamed_since(namespace: str) -> float | None:
    """When an unnamed namespace was made (Unix time), read from its name; None for a
    named one, or an unnamed one of an older release (its name holds no time)."""
    found = _UNNAMED.fullmatch(namespace)
    return float(int(found.group(1), 16)) if found else None


def _announce(kind: str, namespace: str) -> None:
    """Say once per process that an object was built without a namespace, and what
    that means: its values serve it and its copies only, and expire."""
    if _announced.is_set():
        return
    _announced.set()
    logger.warning(
        "asynccache: %s built without namespace=: its values are cached under %r, for it "
        "and its copies (DataLoader workers) only, and expire after %g h; no other run or "
        "job will reuse them: not the other DDP ranks, not this run resumed in a new "
        "process. Pass namespace='<dataset>-v1' (versioned: bump it when the data or its "
        "transform changes) to share them across ranks, runs and jobs.",
        kind, namespace, ANON_TTL / 3600)


class Keyspace:
    """One namespace and the one rule that builds its store keys.

    The core, the pipe and the node all build keys here (``key(k)``), so they agree by
    construction. ``named``: the user gave the namespace (values may be reused by any
    run that gives it); otherwise it is unique to the object that made it, and
    `ttl()` bounds how long its values live. Pickles with its owner: copies share it.
    """

    __slots__ = ("max_key_size", "named", "namespace", "prefix")

    def __init__(self, namespace: str | None, max_key_size: int = DEFAULT_MAX_KEY_SIZE,
                 *, owner: str = "cache") -> None:
        if type(max_key_size) is not int or max_key_size <= 0:
            raise ConfigError(f"max_key_size must be a positive int, got {max_key_size!r}")
        self.named = namespace is not None
        if namespace is None:
            scope = _SCOPE.get()
            if scope is None:
                namespace = unique_namespace()
                _announce(owner, namespace)
            else:
                namespace = scope.next()
                if not scope.quiet:
                    _announce(owner, namespace)
        self.namespace = check_namespace(namespace)
        self.prefix = namespace_prefix(self.namespace)
        self.max_key_size = max_key_size

    def key(self, key: Any) -> bytes:
        """The store key of ``key``: ``prefix + encode_key(key)``, bounded in length."""
        if type(key) is int:  # the hot case (not "%d" for all: it would truncate floats)
            return b"%b%d" % (self.prefix, key)
        store_key = self.prefix + encode_key(key)
        if len(store_key) > self.max_key_size:
            raise KeyTooLong(
                f"store key for {key!r:.60} is {len(store_key)} bytes, over max_key_size="
                f"{self.max_key_size}; use shorter keys (hash long ones yourself, or give "
                "a key_fn) or raise max_key_size")
        return store_key

    def ttl(self, ttl: float | None) -> float | None:
        """The expiry values get: ``ttl`` as given, or ANON_TTL for an unnamed namespace."""
        if ttl is None and not self.named:
            return ANON_TTL
        return ttl

    def renewed(self) -> Keyspace:
        """The keyspace of a new pipeline made by copying this one's owner: the same
        namespace if the user named it, otherwise a new unique one (a deep copy is a new
        pipeline, e.g. ``val = deepcopy(train)`` with another transform, and must never
        read the original's values; pickled copies, DataLoader workers, share them)."""
        if self.named:
            return self
        fresh = Keyspace.__new__(Keyspace)
        fresh.__setstate__((unique_namespace(), False, self.max_key_size))
        return fresh

    def __getstate__(self) -> tuple[str, bool, int]:
        return self.namespace, self.named, self.max_key_size

    def __setstate__(self, state: tuple[str, bool, int]) -> None:
        self.namespace, self.named, self.max_key_size = state
        self.prefix = namespace_prefix(self.namespace)

    def __repr__(self) -> str:
        return f"Keyspace({self.namespace!r}, named={self.named})"


# -- call keys: the decorator's own encoding of a call's arguments --------------------------
#
# Separate from encode_key() on purpose: pipe and node index keys stay byte-identical (no cache
# goes cold on upgrade), while a call's arguments get an encoding exact over types (True, 1,
# 1.0, "1", b"1", (1,), [1] are seven keys) that also covers floats, containers, dates and
# dataclasses. The format, and why it is injective: docs/formats.md, "Call keys".

#: What a call key's encoded part starts with: the version of the call-key format. No
#: `encode_key()` output, chunk or lease key starts with it, so the two schemes never meet.
CALL_TAG = b"f1:"
#: Store keys of calls longer than this are hashed (and always those over max_key_size):
#: memcached keys stay readable and under its 250 bytes, and a long argument is never refused.
CALL_KEY_RAW_MAX = 250
#: Bytes of the BLAKE2b digest of a hashed call key (160 bits: a collision is not a risk).
CALL_DIGEST_BYTES = 20


def type_name(cls: type) -> str:
    """``module.qualname`` of a class: how a type joins a key."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _str(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"s%d:%b" % (len(data), data)


def _decimal(value: decimal.Decimal) -> bytes:
    """An exact canonical text of a Decimal: equal values (``1.0`` and ``1.00``) alike,
    with no rounding (``normalize()`` would round to the context's precision)."""
    if not value.is_finite():
        return b"nan" if value.is_nan() else (b"-inf" if value.is_signed() else b"inf")
    sign, digits, shift = value.as_tuple()
    exponent = int(shift)  # an int for every finite Decimal
    numerals = "".join(map(str, digits)).lstrip("0")
    if not numerals:
        return b"-0" if sign else b"0"
    stripped = numerals.rstrip("0")
    exponent += len(numerals) - len(stripped)
    return b"%s%sE%d" % (b"-" if sign else b"", stripped.encode(), exponent)


def encode_arg(value: Any, what: str = "argument") -> bytes:
    """One argument of a call, type-tagged and self-delimiting (docs/formats.md, "Call
    keys"). ``what`` names the argument in the error for a type it does not cover."""
    kind = type(value)
    if kind is int:
        return b"i%d;" % value
    if kind is str:
        return _str(value)
    if value is None:
        return b"N"
    if kind is bool:
        return b"T" if value else b"F"
    if kind is float:
        return b"f%s;" % (b"nan" if value != value else repr(value).encode())
    if kind is tuple:
        return b"t%d:%b" % (len(value), b"".join(encode_arg(v, what) for v in value))
    if kind is list:
        return b"l%d:%b" % (len(value), b"".join(encode_arg(v, what) for v in value))
    if kind is bytes or kind is bytearray or kind is memoryview:
        data = bytes(value)
        return b"b%d:%b" % (len(data), data)
    if kind is dict:
        pairs = sorted(encode_arg(k, what) + encode_arg(v, what) for k, v in value.items())
        return b"d%d:%b" % (len(pairs), b"".join(pairs))
    if kind is set or kind is frozenset:
        elements = sorted(encode_arg(v, what) for v in value)
        return b"e%d:%b" % (len(elements), b"".join(elements))
    return _encode_other(value, kind, what)


def _encode_other(value: Any, kind: type, what: str) -> bytes:
    """The tagged kinds past the builtin ones: each carries its type's name."""
    named = _str(type_name(kind))
    keyed = getattr(kind, "__cache_key__", None)
    if keyed is not None and not isinstance(value, type):
        return b"K" + named + encode_arg(value.__cache_key__(), what)
    if isinstance(value, enum.Enum):
        return b"E" + named + _str(value.name)
    if isinstance(value, type):
        return b"c" + _str(type_name(value))
    if isinstance(value, datetime.datetime):
        return b"D" + _str(value.isoformat())
    if isinstance(value, datetime.date):
        return b"a" + _str(value.isoformat())
    if isinstance(value, datetime.time):
        return b"h" + _str(value.isoformat())
    if isinstance(value, datetime.timedelta):
        return b"g%d,%d,%d;" % (value.days, value.seconds, value.microseconds)
    if isinstance(value, uuid.UUID):
        return b"u" + value.hex.encode()
    if isinstance(value, decimal.Decimal):
        return b"m" + named + _decimal(value) + b";"
    if isinstance(value, complex):
        return b"j" + named + repr(value).encode() + b";"
    if dataclasses.is_dataclass(value):
        fields = [f for f in dataclasses.fields(value) if f.compare]
        body = b"".join(_str(f.name) + encode_arg(getattr(value, f.name), what) for f in fields)
        return b"C" + named + b"%d:%b" % (len(fields), body)
    if isinstance(value, tuple) and hasattr(kind, "_fields"):  # a NamedTuple
        return b"U" + named + encode_arg(tuple(value), what)
    bases: tuple[Callable[[Any], Any], ...] = (int, float, str, bytes, tuple, list, dict, set,
                                               frozenset)
    for base in bases:
        if isinstance(value, base):  # type: ignore[arg-type]  # a subclass of a builtin: its type, then the value
            return b"X" + named + encode_arg(base(value), what)
    try:
        number = operator.index(value)  # numpy / torch integers: never the int's key
    except TypeError:
        pass
    else:
        return b"x" + named + b"%d;" % number
    raise KeyEncodingError(
        f"cannot build a cache key from {what} {value!r:.60} (a {type_name(kind)}): call keys "
        "cover None, bool, int, float, complex, str, bytes, tuple, list, dict, set, "
        "frozenset, enums, datetime/date/time/timedelta, UUID, Decimal, dataclasses and "
        "NamedTuples of those, and objects with a __cache_key__() method; give the decorator "
        "key=callable (it gets the call's arguments and returns a key), or give the class a "
        "__cache_key__() returning one of those")


def call_store_key(keyspace: Keyspace, body: bytes) -> bytes:
    """The store key of an encoded call: raw when short, else a digest of it (never
    refused for its length)."""
    store_key = keyspace.prefix + CALL_TAG + body
    if len(store_key) <= min(CALL_KEY_RAW_MAX, keyspace.max_key_size):
        return store_key
    digest = hashlib.blake2b(body, digest_size=CALL_DIGEST_BYTES).hexdigest().encode()
    store_key = keyspace.prefix + CALL_TAG + b"#" + digest
    if len(store_key) > keyspace.max_key_size:
        raise KeyTooLong(
            f"the namespace {keyspace.namespace!r} leaves no room for a call key under "
            f"max_key_size={keyspace.max_key_size} (a hashed call key is {len(store_key)} "
            "bytes): use a shorter namespace or raise max_key_size")
    return store_key
