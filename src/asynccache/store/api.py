"""The interface every store client implements, and the per-loop connection plumbing.

A client is a *configuration object*: it holds the URL's settings and opens connections
lazily, in the process and event loop that first uses it. asyncio connections belong to
one loop (redis-py #2838, #3351) and do not survive ``fork`` (redis-py #2910, #3141), so
the live connection state is kept per ``(pid, loop)`` and dropped when pickled. That is
what lets one client object be handed to DataLoader workers under fork, spawn or
forkserver, and be used both from an async service's loop and from asynccache's own
loop thread.

Bytes in, bytes out: keys are ``bytes``, values are ``bytes``; a missing key is ``None``.
Every operation is bounded by ``timeout`` seconds and raises only
:class:`~asynccache.errors.StoreError` subclasses for store trouble.

Two levels of operations:

* ``get_many`` / ``set_many`` / ``delete_many`` / ``ping``: all or nothing; what a simple
  provider implements.
* ``read`` / ``write``: what the core calls. They never raise for store trouble: they
  report it per **node** (``ReadResult.failures``), skip the nodes the failure policy
  says are backing off, and mark keys they could not read as ``NOT_READ``. For a
  single-server store the defaults wrap the first level; a pool or a cluster overrides
  them so that one dead node costs only its own keys.

Passwords never live on the client object: it holds a :class:`Credential`, which says
where the password is (a process-local vault, keyed by a fingerprint of the URL without
secrets, or an environment variable) and is all that a pickle carries. See
:mod:`asynccache.connect` for how child processes find it.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import re
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from .. import _fork
from .._sentinel import Sentinel
from ..errors import ConfigError, StoreError, StoreTimeout, Unsupported

__all__ = [
    "CREDENTIALS_ENV_PREFIX",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "NOT_READ",
    "BaseClient",
    "BlockingGetConnection",
    "ConsumerReads",
    "Credential",
    "ReadResult",
    "WriteResult",
]

DEFAULT_TIMEOUT = 1.0
DEFAULT_CONNECT_TIMEOUT = 1.0
DEFAULT_MAX_BATCH = 256

StateT = TypeVar("StateT")
T = TypeVar("T")


class NOT_READ(Sentinel, metaclass=Sentinel):
    """A key that was not read (its node failed or is backing off).

    Not the same as ``None`` (read, and absent): read-ahead drops a ``NOT_READ`` key
    instead of remembering it as a miss, so a failure never outlives itself.
    """


@dataclass(slots=True)
class ReadResult:
    """One read: a value per key (``None``: absent, ``NOT_READ``: not read), and per node
    what failed, who answered, and how many keys were skipped (node backing off)."""

    values: list[Any]
    failures: dict[str, StoreError] = field(default_factory=dict)
    answered: list[str] = field(default_factory=list)
    skipped: int = 0


@dataclass(slots=True)
class WriteResult:
    """One write: per node what failed (its keys were not written), per key what the
    store refused (``StoreRejected``), who answered, and the keys written."""

    written: int = 0
    failures: dict[str, StoreError] = field(default_factory=dict)
    failed_keys: int = 0
    rejected: dict[bytes, StoreError] = field(default_factory=dict)
    answered: list[str] = field(default_factory=list)
    skipped: int = 0


class BlockingGetConnection(Protocol):
    """A pipelined multi-get connection the consumer thread drives itself (no event loop).

    Requests are answered in order. Every request has a deadline (``timeout`` after it
    was sent): past it :meth:`receive` raises ``StoreTimeout`` and the connection is
    closed, so a stuck or trickling server costs at most one timeout.
    """

    node: str

    def send_get(self, keys: Sequence[bytes]) -> None:
        """Queue one multi-get; raises StoreError (the connection is then closed)."""

    def poll(self, limit: int | None = None) -> list[list[Any]]:
        """Every reply that has fully arrived (at most ``limit``), without blocking."""

    def receive(self) -> list[Any]:
        """The next reply, waiting at most until the oldest request's deadline."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ConsumerReads:
    """What a store offers for reads on the consumer's own sockets: its connections (one
    per node) and ``route(keys)`` → ``[(connection index, positions of keys)]``."""

    connections: list[BlockingGetConnection]
    route: Callable[[Sequence[bytes]], list[tuple[int, list[int]]]]
    #: how many nodes a batch is spread over: read-ahead holds ``prefetch`` items per
    #: node, so that each node's requests stay as large as one server's would be
    fanout: int = 1


# -- credentials: out of the client, its pickles and its reprs -------------------------------
#: A client created with a password exports it once, as ``CREDENTIALS_ENV_PREFIX +
#: fingerprint``, so that spawn/forkserver children (fresh interpreters, empty vault)
#: find it when they unpickle the client.
CREDENTIALS_ENV_PREFIX = "ASYNCCACHE_CREDENTIALS_"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: fingerprint -> password, for this process (a forked child inherits it)
_vault: dict[str, str] = {}
_vault_lock = threading.Lock()


@dataclass(frozen=True)
class Credential:
    """Where a client's password is, never the password: pickled with the client.

    Either ``fingerprint`` (the password is in this process' vault, or in the variable
    ``CREDENTIALS_ENV_PREFIX + fingerprint`` that the creating process exported) or
    ``env`` (the user's own variable, ``password_env``; nothing is exported).
    """

    fingerprint: str | None = None
    env: str | None = None

    @classmethod
    def keep(cls, where: str, password: str | None, password_env: str | None
             ) -> Credential | None:
        """Put ``password`` in the vault (and the environment) under a fingerprint of
        ``where``, the URL without secrets; or check that ``password_env`` is set."""
        if password_env is not None:
            if password is not None:
                raise ConfigError(f"{where}: give the password in the URL or through "
                                  "password_env, not both")
            if not _ENV_NAME.fullmatch(password_env):
                raise ConfigError(f"password_env={password_env!r} is not an environment "
                                  "variable name")
            if password_env not in os.environ:
                raise ConfigError(f"password_env={password_env}: that environment variable "
                                  f"is not set (it holds the password for {where})")
            return cls(env=password_env)
        if password is None:
            return None
        base = hashlib.sha256(where.encode()).hexdigest()[:16]
        with _vault_lock:
            # another password for the same URL (say, a wrong one in a test) gets a slot
            # of its own rather than replacing the first one's
            for n in itertools.count():
                fingerprint = base if n == 0 else f"{base}_{n}"
                name = CREDENTIALS_ENV_PREFIX + fingerprint
                held = _vault.get(fingerprint, os.environ.get(name))
                if held is None or held == password:
                    _vault[fingerprint] = password
                    if os.environ.get(name) != password:
                        os.environ[name] = password
                    return cls(fingerprint=fingerprint)
        raise AssertionError("unreachable")  # pragma: no cover

    def resolve(self, where: str) -> str:
        """The password, in this process; ConfigError saying how to provide it when this
        process cannot know it (a client unpickled from a checkpoint elsewhere)."""
        if self.env is not None:
            value = os.environ.get(self.env)
            if value is None:
                raise ConfigError(
                    f"the password for {where} is read from the environment variable "
                    f"{self.env} (password_env), which is not set in this process "
                    f"(pid {os.getpid()}): set it wherever the client is used")
            return value
        assert self.fingerprint is not None
        value = _vault.get(self.fingerprint)
        if value is None:
            name = CREDENTIALS_ENV_PREFIX + self.fingerprint
            value = os.environ.get(name)
            if value is None:
                raise ConfigError(
                    f"the password for {where} is not known in this process (pid "
                    f"{os.getpid()}): a pickled client carries no password, and this "
                    f"process did not inherit {name} from the one that created the client "
                    "(e.g. it was loaded from a checkpoint, or started by a forkserver "
                    "that was already running). Keep the password in an environment "
                    "variable set in every process and pass password_env='THAT_VARIABLE' "
                    f"to connect() (or ?password_env= in the URL), or set {name} here")
            with _vault_lock:
                _vault[self.fingerprint] = value
        return value


class BaseClient(ABC, Generic[StateT]):
    """Common configuration, lazy per-loop state, pickling and timeouts.

    Subclasses implement ``_open_state`` (build the library client for the running loop,
    without network I/O), ``_close_state`` and the four operations.
    """

    scheme: ClassVar[str]
    #: Largest value the store accepts in one item; ``None`` means "no practical limit".
    max_value_size: int | None = None
    #: How much later than asked an expiry may happen (memcached counts whole seconds):
    #: a process waiting on another's lease waits this much longer before giving up.
    expiry_slack: ClassVar[float] = 0.0
    #: Where the password is (no secret: pickled as it is); None for a store without one.
    _credential: Credential | None = None

    @property
    def password(self) -> str | None:
        """The password, looked up in this process (ConfigError when it cannot be)."""
        return None if self._credential is None else self._credential.resolve(self.safe_url)

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_batch = int(max_batch)
        self._init_runtime()

    # -- runtime state ------------------------------------------------------------------
    def _init_runtime(self) -> None:
        self._generation = _fork.generation
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StateT] = (
            weakref.WeakKeyDictionary()
        )
        self._users: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = (
            weakref.WeakKeyDictionary()
        )

    def _forked(self) -> bool:
        """True (and the inherited state parked) in a forked child: its sockets are not ours."""
        if self._generation == _fork.generation:
            return False
        _fork.park_inherited((self._states, self._users))
        self._init_runtime()
        return True

    def _state(self) -> StateT:
        """The connection state for the running loop, created on first use."""
        self._forked()
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            state = self._open_state()
            self._states[loop] = state
        return state

    @abstractmethod
    def _open_state(self) -> StateT:
        """Create the per-loop client objects (no network I/O here)."""

    @abstractmethod
    async def _close_state(self, state: StateT) -> None:
        """Close what ``_open_state`` created."""

    async def close(self) -> None:
        """Close this loop's connections. The client stays usable: it reconnects lazily."""
        if self._forked():
            return
        loop = asyncio.get_running_loop()
        state = self._states.pop(loop, None)
        if state is not None:
            await self._close_state(state)

    def retain(self) -> None:
        """Count one more user of this loop's connections (call from inside the loop).

        Caches and pipes sharing one client in one loop retain it, and :meth:`release`
        it when done: the connections close when the last user leaves, never under a
        user that still has requests in flight.
        """
        loop = asyncio.get_running_loop()
        self._users[loop] = self._users.get(loop, 0) + 1

    async def release(self) -> None:
        """One user fewer; close this loop's connections when none is left."""
        if self._forked():
            return
        loop = asyncio.get_running_loop()
        users = self._users.get(loop, 0) - 1
        if users > 0:
            self._users[loop] = users
            return
        self._users.pop(loop, None)
        await self.close()

    async def _bounded(self, awaitable: Awaitable[T], what: str) -> T:
        """Await with the client's timeout, translating the timeout to StoreTimeout."""
        try:
            return await asyncio.wait_for(awaitable, self.timeout)
        except asyncio.TimeoutError as exc:
            raise StoreTimeout(
                f"{self.scheme} store did not answer {what} within {self.timeout:g}s "
                f"({self.safe_url}); raise `timeout=` in connect() if the store is just slow"
            ) from exc

    # -- pickling: configuration only -------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_states", None)
        state.pop("_users", None)
        state.pop("_generation", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # -- description ------------------------------------------------------------------------
    @property
    @abstractmethod
    def safe_url(self) -> str:
        """The URL with any password masked: safe for reprs and logs."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.safe_url!r})"

    # -- operations ---------------------------------------------------------------------------
    @abstractmethod
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values for ``keys`` in the same order, ``None`` where missing."""

    @abstractmethod
    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        """Store every pair; ``ttl`` in seconds (``None``: no expiry)."""

    @abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys``; missing keys are ignored."""

    @abstractmethod
    async def ping(self) -> None:
        """Round trip to every server; raises StoreError when one does not answer."""

    # -- administration: what the command line (ping, stats, flush, warm) calls --------
    # Not on the data path. A provider may leave scan() as is: stats and flush then say
    # the store cannot list keys; the other two have defaults that work everywhere.
    async def server_info(self) -> dict[str, Any]:
        """What is known about the store: ``max_value_size`` and, where the store can say,
        ``nodes``: ``{node name: {"server": ..., "version": ..., "item_size": ...}}``.

        This default does no I/O; network providers ask every node."""
        return {"max_value_size": self.max_value_size}

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        """Every key that starts with ``prefix``, in batches of about ``batch`` (store key,
        size of its value in bytes or ``None`` when unknown); every node of a pool or
        cluster. Keys are yielded as :meth:`delete_many` and :meth:`contains_many` take
        them. Like Redis ``SCAN``, a key may be yielded twice if the store reorganises
        itself meanwhile, and keys written meanwhile may or may not appear."""
        raise Unsupported(f"{self.safe_url}: this store ({type(self).__name__}) cannot list "
                          "its keys, so asynccache stats and flush cannot find a namespace's "
                          "keys; delete them with the store's own tools")
        yield []  # pragma: no cover - makes this an async generator, as overrides are

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the store holds it. This default reads the values;
        providers override it with a check that does not transfer them."""
        return [value is not None for value in await self.get_many(keys)]

    async def sizes_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """For each key, the size in bytes of the value the store holds under it, or
        ``None`` when it holds none (nor an empty one: asynccache never writes one).
        What ``asynccache warm`` checks before it skips a key. This default reads the
        values; stores override it with a check that transfers none of them."""
        return [len(value) or None if value is not None else None
                for value in await self.get_many(keys)]

    # -- what the core calls: per-node results, never raising for store trouble -------
    @property
    def node_names(self) -> tuple[str, ...]:
        """The nodes failures are tracked for; one (the URL) for a single server."""
        return (self.safe_url,)

    async def read(self, keys: Sequence[bytes], skip: Collection[str] = ()) -> ReadResult:
        """Values for ``keys``; failures reported per node, never raised."""
        node = self.node_names[0]
        if node in skip:
            return ReadResult([NOT_READ] * len(keys), skipped=len(keys))
        try:
            values: list[Any] = list(await self.get_many(keys))
        except StoreError as exc:
            return ReadResult([NOT_READ] * len(keys), failures={node: exc})
        except ConfigError:  # e.g. no password in this process: for the user to fix
            raise
        except Exception as exc:  # a provider bug must not stop training either
            return ReadResult([NOT_READ] * len(keys), failures={node: _foreign(self, exc)})
        return ReadResult(values, answered=[node])

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[str] = ()) -> WriteResult:
        """Store ``entries``; failures reported per node (and per refused key)."""
        node = self.node_names[0]
        if node in skip:
            return WriteResult(skipped=len(entries))
        try:
            await self.set_many(entries, ttl)
        except StoreError as exc:
            return WriteResult(failures={node: exc}, failed_keys=len(entries))
        except ConfigError:
            raise
        except Exception as exc:
            return WriteResult(failures={node: _foreign(self, exc)}, failed_keys=len(entries))
        return WriteResult(written=len(entries), answered=[node])

    def consumer_reads(self) -> ConsumerReads | None:
        """Connections the consumer thread can drive itself (read-ahead without a thread
        hop), or None when this store's reads go through the event loop."""
        return None

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        """Store each pair only where the key is absent, expiring after ``ttl`` seconds;
        True where stored. What ``lease=`` is built on (Redis ``SET NX PX``, memcached
        ``add``); a store without it cannot take leases."""
        raise NotImplementedError(f"{type(self).__name__} has no add_many (set if absent)")

    async def get(self, key: bytes) -> bytes | None:
        return (await self.get_many([key]))[0]

    async def set(self, key: bytes, value: bytes, ttl: float | None = None) -> None:
        await self.set_many({key: value}, ttl)


def _foreign(client: BaseClient[Any], exc: Exception) -> StoreError:
    error = StoreError(f"{client.safe_url}: the store client raised {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def chunked(seq: Sequence[T], size: int) -> list[Sequence[T]]:
    """``seq`` cut into consecutive slices of at most ``size`` items."""
    return [seq[i : i + size] for i in range(0, len(seq), size)]
