"""A cache's settings, checked once, where they are given.

`AsyncKVCache`, the pipe and the node take the same settings; each builds one
`CacheSettings` in its constructor, so a wrong setting is a `ConfigError` in the caller
(not later, in a DataLoader worker), and no part checks them again. The object is frozen
and pickles with its client (configuration only: it connects lazily in each process), so
a pipe's copies in DataLoader workers build their caches from the very settings checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..store.api import BaseClient
from .codec import DEFAULT_CODEC, Codec
from .expiry import check_ttl
from .health import OnError
from .keys import Keyspace

__all__ = ["CacheSettings", "SettingsView"]


@dataclass(frozen=True, eq=False)
class CacheSettings:
    """What one cache is built from. Durations are given as seconds or a
    ``datetime.timedelta`` and held as seconds; ``codec=None`` is the default codec."""

    #: the byte store, from `asynccache.connect()`
    client: BaseClient[Any]
    #: the namespace and its key rule
    keyspace: Keyspace
    #: how long values live in the store (None: no expiry; an unnamed namespace: a day)
    ttl: Any = None
    codec: Codec | None = None
    #: "fallback" (a store failure is a counted miss) or "raise"
    on_error: OnError = "fallback"
    #: seconds a lease lasts (None: leases off)
    lease: Any = None
    #: bytes of the in-process tier (None: none)
    l1_bytes: int | None = None
    chunking: bool = True
    max_in_flight: int = 4
    max_pending_writes: int = 10_000

    def __post_init__(self) -> None:
        """The one check of every setting: `ConfigError` saying what is accepted."""
        if not isinstance(self.client, BaseClient):
            raise ConfigError(f"client must come from asynccache.connect(url), got "
                              f"{type(self.client).__name__}")
        if not isinstance(self.keyspace, Keyspace):
            raise ConfigError(f"keyspace must be a Keyspace, got {type(self.keyspace).__name__}")
        if self.on_error not in ("fallback", "raise"):
            raise ConfigError(f"on_error must be 'fallback' or 'raise', got {self.on_error!r}")
        l1_bytes = self.l1_bytes
        if l1_bytes is not None and (type(l1_bytes) is not int or l1_bytes <= 0):
            raise ConfigError(f"l1_bytes must be a positive int (bytes of encoded values "
                              f"kept in this process) or None, got {l1_bytes!r}")
        for name in ("max_in_flight", "max_pending_writes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        # held as seconds: set through object.__setattr__, as a frozen dataclass allows
        object.__setattr__(self, "ttl", check_ttl(self.ttl))
        object.__setattr__(self, "lease", check_ttl(
            self.lease, "lease (the longest one batch of misses may take to compute, in "
                        "seconds)"))
        if self.codec is None:
            object.__setattr__(self, "codec", DEFAULT_CODEC)

    @property
    def checked_codec(self) -> Codec:
        """The codec in use (``codec=None`` became the default one when checked)."""
        assert self.codec is not None  # set in __post_init__
        return self.codec

    @property
    def store_ttl(self) -> float | None:
        """The ttl values are written with: an unnamed namespace's values expire after a
        day even without one (see `Keyspace.ttl()`)."""
        return self.keyspace.ttl(self.ttl)


class SettingsView:
    """What an owner of a cache (the cache itself, a pipe, a node) says of its settings,
    read from its `CacheSettings` (``self.settings``, set by its constructor): the
    settings are kept once, never copied into attributes of their own."""

    settings: CacheSettings

    @property
    def client(self) -> BaseClient[Any]:
        """The store client."""
        return self.settings.client

    @property
    def keyspace(self) -> Keyspace:
        """The namespace and its key rule (a pipe's or node's copies build the same keys)."""
        return self.settings.keyspace

    @property
    def namespace(self) -> str:
        """The namespace values are stored under."""
        return self.settings.keyspace.namespace

    @property
    def prefix(self) -> bytes:
        """What every store key of this owner starts with."""
        return self.settings.keyspace.prefix

    @property
    def ttl(self) -> float | None:
        """Seconds values live in the store (an unnamed namespace's: a day at most)."""
        return self.settings.store_ttl

    @property
    def codec(self) -> Codec:
        """How values become bytes."""
        return self.settings.checked_codec

    @property
    def lease(self) -> float | None:
        """Seconds a lease lasts (None: leases off)."""
        seconds: float | None = self.settings.lease  # given as seconds or a timedelta
        return seconds

