"""The exceptions asynccache raises.

Every exception that crosses the public API derives from `CacheError`, so
``except ac.CacheError`` is enough. Foreign exceptions (redis-py's, hiredis',
pickle's, OS errors) are translated at the boundary with ``raise ... from exc``:
redis-py's ``ConnectionError``/``TimeoutError`` shadow the builtins and never escape.

```text
CacheError
├── ConfigError            a setting the user must fix
│   ├── InvalidURL         connect() could not parse the URL
│   ├── KeyTooLong         namespace + key longer than the store accepts
│   ├── KeyEncodingError   a key of a type the documented key encoding does not cover
│   │   └── MethodKeyError a cached method's instance gives no key (__cache_key__ / noself)
│   ├── MissingDependency  an optional package (torch, zstandard, ...) is needed
│   └── Unsupported        the store cannot do what was asked (e.g. list its keys)
├── EncodeError            the value cannot be serialised (unpicklable, too large)
│   └── ValueTooLarge      larger than the store allows and chunking is off
├── DecodeError            bytes under a key are not a value asynccache wrote for that key
│   ├── FormatMismatch     a value of another asynccache format version: a plain miss
│   └── SignatureError     not signed by any secret of a Codec(secret=...): a forgery
├── ClosedError            a pipe, node or cache used after close()
├── StoreError             the store failed: the core turns these into misses
│   ├── StoreUnavailable   connection refused / reset / closed
│   ├── StoreTimeout       no answer within the configured timeout
│   └── StoreRejected      the store refused one value (too large for it, out of memory)
└── LoopError              the sync API was called from its own loop thread
```
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "ClosedError",
    "ConfigError",
    "DecodeError",
    "EncodeError",
    "FormatMismatch",
    "InvalidURL",
    "KeyEncodingError",
    "KeyTooLong",
    "LoopError",
    "MethodKeyError",
    "MissingDependency",
    "SignatureError",
    "StoreError",
    "StoreRejected",
    "StoreTimeout",
    "StoreUnavailable",
    "Unsupported",
    "ValueTooLarge",
]


class CacheError(Exception):
    """Root of every error asynccache raises."""


class ConfigError(CacheError, ValueError):
    """A configuration problem that the user has to fix."""


class InvalidURL(ConfigError):
    """``connect()`` was given a URL it cannot use."""


class KeyTooLong(ConfigError):
    """A namespace or key is longer than the store accepts."""


class KeyEncodingError(ConfigError, TypeError):
    """A key (or dataset index) of a type the documented key encoding does not cover."""


class MethodKeyError(KeyEncodingError):
    """A cached method was called on an instance that cannot join the key: the class has
    no ``__cache_key__()`` and the decorator was not given ``noself=True``."""


class MissingDependency(ConfigError, ImportError):
    """An optional dependency is needed for the requested feature."""


class Unsupported(ConfigError):
    """The store (or its provider) cannot do what was asked, such as listing its keys for
    ``asynccache stats`` / ``flush``; the message names what to use instead."""


class EncodeError(CacheError):
    """A value could not be serialised for the store."""


class ValueTooLarge(EncodeError):
    """A serialised value is larger than the store accepts."""


class DecodeError(CacheError):
    """Bytes in the store are not a value written by asynccache (or are damaged)."""


class FormatMismatch(DecodeError):
    """The value was written by an asynccache with another format version.

    Not damage and not an attack: the core treats it as a plain miss (and overwrites it).
    """


class SignatureError(DecodeError):
    """Bytes under a key were not signed by any of this codec's secrets: a miss; someone
    without the secret wrote them.

    Raised only by a ``Codec(secret=...)``, for unsigned, forged, truncated, damaged or
    differently-signed values, before any byte of them is decompressed or unpickled. The
    core counts it apart from other decode errors: it means a writer of the store holds
    no secret of this codec (a peer not yet configured, or an attacker).
    """


class StoreError(CacheError):
    """The store failed to answer; in fallback mode this becomes a miss."""


class StoreUnavailable(StoreError, ConnectionError):
    """The store could not be reached, or the connection broke."""


class StoreTimeout(StoreError, TimeoutError):
    """The store did not answer within the configured timeout."""


class StoreRejected(StoreError):
    """The store answered, but refused one value (over its size limit, out of memory).

    Only that key fails; the message names the server limit to raise.
    """


class ClosedError(CacheError, RuntimeError):
    """A pipe, node or cache was used after ``close()``: build a new one. Its counters
    are kept (``stats()`` still answers with the final numbers)."""


class LoopError(CacheError, RuntimeError):
    """The synchronous API was called from inside asynccache's own loop thread."""
