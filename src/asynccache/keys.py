"""User keys and dataset indices → store keys: one documented, injective encoding.

Store key = ``b"ac:" + namespace + b":" + encode_key(key)``, where ``encode_key`` is:

=====================  =========================================  ==================
key                    encoded as                                 example
=====================  =========================================  ==================
int (and anything      decimal ASCII                              ``42``, ``-3``
``operator.index()``
accepts: numpy / torch
integers, 0-d integer
tensors, bool)
str                    ``s:`` + UTF-8                             ``s:cat.jpg``
bytes                  ``b:`` + the bytes                         ``b:\\x00\\x01``
tuple                  ``t:`` + for each element                  ``(1, "a")`` →
                       ``<len>:<encoded element>``                ``t:1:13:s:a``
=====================  =========================================  ==================

Why it is injective: an int encodes to ``-?[0-9]+``, which never starts with a letter;
every other kind starts with its own tag letter and a colon; a tuple's elements are
length-prefixed, so ``("a:b",)`` and ``("a", "b")`` differ. Integers keep the short
form because they are the common case (dataset indices) and ``key_for(i)`` is
documented as ``b"ac:" + namespace + b":" + str(i)``. ``True`` and ``1`` are one key,
as they are one key of a Python dict. Anything else (floats, None, objects) raises
:class:`~asynccache.errors.KeyEncodingError`: its string form is not a stable identity.

The other keys asynccache keeps for an entry sit under the same namespace prefix (so a
namespace is one ``SCAN MATCH ac:<ns>:*`` away), tagged with letters no encoded key
starts with, so they can never be mistaken for a value's key:

* chunk ``i`` of a value split over several items:
  ``b"ac:" + ns + b":c:" + token + b":" + str(i) + b":" + encode_key(key)``
* the lease of a key being computed (``lease=``): ``b"ac:" + ns + b":l:" + encode_key(key)``
"""

from __future__ import annotations

import operator
from typing import Any

from .errors import ConfigError, KeyEncodingError, KeyTooLong

__all__ = [
    "MAX_NAMESPACE_BYTES",
    "check_namespace",
    "chunk_keys",
    "encode_key",
    "lease_key",
    "namespace_prefix",
]

MAX_NAMESPACE_BYTES = 200


def encode_key(key: Any) -> bytes:
    """``key`` → bytes by the rule in the module docstring."""
    if type(key) is int:  # the hot case first
        return b"%d" % key
    if isinstance(key, str):
        return b"s:" + key.encode("utf-8", "surrogatepass")
    if isinstance(key, bytes | bytearray | memoryview):
        return b"b:" + bytes(key)
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


def check_namespace(namespace: str | None, default: str = "default") -> str:
    """A valid namespace: a non-empty str of at most MAX_NAMESPACE_BYTES UTF-8 bytes."""
    if namespace is None:
        return default
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
    """The keys of a chunked value's chunks (see the module docstring)."""
    prefix, encoded = _split(store_key)
    stem = prefix + b"c:" + token.encode() + b":"
    return [b"%b%d:%b" % (stem, i, encoded) for i in range(chunks)]


def lease_key(store_key: bytes) -> bytes:
    """The key of the lease on a value's store key (see the module docstring)."""
    prefix, encoded = _split(store_key)
    return prefix + b"l:" + encoded
