"""The store interface: what the cache layer calls, and what a consumer thread reads on.

A client (`BaseClient`) is picklable configuration; it opens its connections lazily, per
process and event loop. The cache calls `BaseClient.read()` and `BaseClient.write()`, which
report per node (`ReadResult`, `WriteResult`) and never raise for store trouble;
``get_many``/``set_many`` are the all-or-nothing forms derived from them. A store that is
one node answering all or nothing (`SimpleStore`: providers, memory) goes the other way,
through the one adapter, `read_one_node()` / `write_one_node()`. Read-ahead on a consumer's
own thread uses `ConsumerConnection`s (`BaseClient.consumer_reads()`).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, NewType, TypeVar

from .. import _fork
from .._interrupts import raised_in_signal_handler
from .._sentinel import Sentinel
from ..errors import CacheError, ConfigError, StoreError, Unsupported
from .credentials import Credential

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "NOT_READ",
    "READ_TTL",
    "STORE_COUNTS",
    "AnsweredAtSend",
    "BaseClient",
    "ConsumerConnection",
    "ConsumerReads",
    "NodeName",
    "ReadResult",
    "SimpleStore",
    "WriteResult",
    "count",
    "read_one_node",
    "write_one_node",
]

DEFAULT_TIMEOUT = 1.0
DEFAULT_CONNECT_TIMEOUT = 1.0
DEFAULT_MAX_BATCH = 256

StateT = TypeVar("StateT")
T = TypeVar("T")

#: A node of a store, by name: ``host:port`` of a pool member or cluster primary, the
#: URL (password masked) of a single server. Failures are counted, and backed off, per
#: node: by the cache's failure policy, under this name.
NodeName = NewType("NodeName", str)


#: Where a store adds counts of its own (a tiered client's copies into its near store): a
#: cache sets its counters' ``add`` here around each read and write it sends, so that
#: what the store counts -- later too, in a task the request started, which inherits the
#: context -- lands in that cache's ``stats()``. Unset (a bare client, the command line):
#: the counts are not kept.
STORE_COUNTS: contextvars.ContextVar[Callable[[str, int], None] | None] = (
    contextvars.ContextVar("asynccache_store_counts", default=None))


#: The expiry of the values of the cache whose read is running (its ``ttl``; an unnamed
#: namespace's day), set by the cache around each read it sends. A store that keeps a
#: copy of what it read (a tiered client's near) gives the copy no longer: the original
#: expires within that much, and a copy without expiry would outlive it for ever. None
#: (unset, or a cache without ttl): no bound.
READ_TTL: contextvars.ContextVar[float | None] = (
    contextvars.ContextVar("asynccache_read_ttl", default=None))


def count(name: str, n: int) -> None:
    """Add ``n`` to the counter ``name`` of the cache whose request is running, if any."""
    if n:
        add = STORE_COUNTS.get()
        if add is not None:
            add(name, n)


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
    failures: dict[NodeName, StoreError] = field(default_factory=dict)
    answered: list[NodeName] = field(default_factory=list)
    skipped: int = 0


@dataclass(slots=True)
class WriteResult:
    """One write: per node what failed (its keys were not written), per key what the
    store refused (``StoreRejected``), who answered, and the keys written."""

    written: int = 0
    failures: dict[NodeName, StoreError] = field(default_factory=dict)
    failed_keys: int = 0
    rejected: dict[bytes, StoreError] = field(default_factory=dict)
    answered: list[NodeName] = field(default_factory=list)
    skipped: int = 0


# -- the consumer side: connections a consumer thread drives itself -----------------------
class ConsumerConnection(ABC):
    """A pipelined multi-get connection of one node, driven by one consumer thread.

    Requests are answered in order, one reply (a value per key) per `send_get()`.
    Every request has a deadline (``timeout`` after it was sent): past it
    `receive()` raises ``StoreTimeout`` and the connection is closed, so a stuck or
    trickling server costs at most one timeout. Any failure closes the connection with
    everything queued on it: no reply is ever matched to another request.
    """

    #: the node this connection reads from (failures are counted under it)
    node: NodeName
    #: values it returns that are not ``bytes`` are memory of their own (one allocation
    #: per value, never reused or kept by the connection): the cache decodes arrays and
    #: tensors as views of it, without a copy. False: every value is copied out.
    owns_buffers: bool = False

    @abstractmethod
    def send_get(self, keys: Sequence[bytes]) -> None:
        """Queue one multi-get; raises StoreError (the connection is then closed)."""

    @abstractmethod
    def poll(self, limit: int | None = None) -> list[list[Any]]:
        """Every reply that has fully arrived (at most ``limit``), without blocking."""

    @abstractmethod
    def receive(self) -> list[Any]:
        """The next reply, waiting at most until the oldest request's deadline."""

    @abstractmethod
    def close(self) -> None:
        """Drop every request and reply queued; the next request reconnects."""

    def extend_deadlines(self, at_least: float) -> None:
        """Give every pending request until ``at_least`` (``time.monotonic()``): the
        consumer was away while the replies waited. Nothing in flight: nothing to do."""
        return None


class AnsweredAtSend(ConsumerConnection):
    """A "connection" that reads each request at once, in the caller's thread, and queues
    the reply (a local file, or keys sent through another path): nothing is ever in
    flight, so nothing can time out. Subclasses implement `read()`."""

    def __init__(self) -> None:
        self.replies: collections.deque[list[Any]] = collections.deque()

    @abstractmethod
    def read(self, keys: Sequence[bytes]) -> list[Any]:
        """The values of ``keys``, now; raises StoreError."""

    def send_get(self, keys: Sequence[bytes]) -> None:
        """Read ``keys`` and queue the reply. A failure drops the replies held, like a
        broken socket (the caller counts their requests as lost; keeping them would hand
        them to later requests)."""
        try:
            values = self.read(keys)
        except CacheError:
            self.replies.clear()
            raise
        except Exception as exc:  # a bug (here or in a subclass) must not stop training
            self.replies.clear()
            if raised_in_signal_handler(exc):
                raise  # the caller's interrupt, unchanged
            raise StoreError(f"{self.node}: reading raised {type(exc).__name__}: "
                             f"{exc}") from exc
        self.replies.append(values)

    def poll(self, limit: int | None = None) -> list[list[Any]]:
        replies = self.replies
        n = len(replies) if limit is None else min(limit, len(replies))
        return [replies.popleft() for _ in range(n)]

    def receive(self) -> list[Any]:
        if not self.replies:
            raise StoreError("receive() with no request pending (asynccache bug)")
        return self.replies.popleft()

    def close(self) -> None:
        self.replies.clear()


#: ``route(keys)`` -> ``[(connection index, positions of its keys)]``
Route = Callable[[Sequence[bytes]], list[tuple[int, list[int]]]]


def single_node(keys: Sequence[bytes]) -> list[tuple[int, list[int]]]:
    """The route of a store with one connection: every key to it."""
    return [(0, list(range(len(keys))))]


@dataclass(frozen=True, slots=True)
class ConsumerReads:
    """What a store offers for reads on the consumer's own sockets: its connections (one
    per node) and ``route(keys)`` → ``[(connection index, positions of keys)]``."""

    connections: Sequence[ConsumerConnection]
    route: Route = single_node
    #: how many nodes a batch is spread over: read-ahead holds ``prefetch`` items per
    #: node, so that each node's requests stay as large as one server's would be
    fanout: int = 1


class BaseClient(ABC, Generic[StateT]):
    """Common configuration, lazy per-loop state, pickling and timeouts.

    Subclasses implement ``_open_state`` (build the library client for the running loop,
    without network I/O), ``_close_state``, ``read``, ``write``, ``delete_many`` and
    ``ping``.

    Args:
        timeout: seconds each operation may take, end to end.
        connect_timeout: seconds opening a connection may take.
        max_batch: keys per multi-get request.
    """

    scheme: ClassVar[str]
    max_value_size: int | None = None
    """Largest value the store accepts in one item; ``None`` means "no practical limit"."""
    #: Values live in this process only (``memory://``): DataLoader workers, other
    #: processes and machines never see them (the pipe warns when used in a worker).
    process_local: ClassVar[bool] = False
    #: `read()` hands out values of 64 KiB or more as memory of their own (writable
    #: buffers nothing else holds, received in place), not ``bytes``: the cache decodes
    #: them without a copy. `get_many()` still returns ``bytes``.
    reads_own_buffers: ClassVar[bool] = False
    expiry_slack: ClassVar[float] = 0.0
    """How much later than asked an expiry may happen (memcached counts whole seconds):
    a process waiting on another's lease waits this much longer before giving up."""
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

        Caches and pipes sharing one client in one loop retain it, and `release()`
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

    # -- what the core calls: per-node results, never raising for store trouble ----------
    @property
    def node_names(self) -> tuple[NodeName, ...]:
        """The nodes failures are tracked for; one (the URL) for a single server."""
        return (NodeName(self.safe_url),)

    @abstractmethod
    async def read(self, keys: Sequence[bytes], skip: Collection[NodeName] = ()) -> ReadResult:
        """Values for ``keys``; failures reported per node, never raised; the keys of the
        nodes in ``skip`` (backing off) are not asked for (``NOT_READ``)."""

    @abstractmethod
    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        """Store ``entries``; failures reported per node (and per refused key)."""

    def consumer_reads(self) -> ConsumerReads | None:
        """Connections the consumer thread can drive itself (read-ahead without a thread
        hop), or None when this store's reads go through the event loop."""
        return None

    # -- all or nothing: what the command line, tests and simple callers use -------------
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values for ``keys`` in the same order, ``None`` where missing; raises the
        first node's failure."""
        result = await self.read(keys)
        for error in result.failures.values():
            raise error
        if self.reads_own_buffers:  # bytes out, as promised
            return [v if v is None or type(v) is bytes else bytes(v) for v in result.values]
        return result.values

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        """Store every pair; ``ttl`` in seconds (``None``: no expiry); raises the first
        failure or refusal."""
        result = await self.write(mapping, ttl)
        for error in (*result.failures.values(), *result.rejected.values()):
            raise error

    @abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys``; missing keys are ignored."""

    @abstractmethod
    async def ping(self) -> None:
        """Round trip to every server; raises StoreError when one does not answer."""

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        """Store each pair only where the key is absent, expiring after ``ttl`` seconds;
        True where stored. What ``lease=`` is built on (Redis ``SET NX PX``, memcached
        ``add``); a store without it cannot take leases."""
        raise NotImplementedError(f"{type(self).__name__} has no add_many (set if absent)")

    async def get(self, key: bytes) -> bytes | None:
        """The value of one key, or ``None``."""
        return (await self.get_many([key]))[0]

    async def set(self, key: bytes, value: bytes, ttl: float | None = None) -> None:
        """Store one pair (as `set_many()`)."""
        await self.set_many({key: value}, ttl)

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
        cluster. Keys are yielded as `delete_many()` and `contains_many()` take
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


class SimpleStore(BaseClient[StateT]):
    """A store that is one node and answers all or nothing: it implements ``get_many``
    and ``set_many``; ``read`` and ``write`` adapt them (`read_one_node()`,
    `write_one_node()`). The base of `Provider`."""

    @abstractmethod
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values for ``keys`` in the same order, ``None`` where missing."""

    @abstractmethod
    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        """Store every pair; ``ttl`` in seconds (``None``: no expiry)."""

    async def read(self, keys: Sequence[bytes], skip: Collection[NodeName] = ()) -> ReadResult:
        return await read_one_node(self, self.get_many, keys, skip)

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        return await write_one_node(self, self.set_many, entries, ttl, skip)


# -- the one adapter: all-or-nothing operations as per-node results ----------------------
async def read_one_node(client: BaseClient[Any],
                        get_many: Callable[[Sequence[bytes]], Awaitable[list[bytes | None]]],
                        keys: Sequence[bytes], skip: Collection[NodeName]) -> ReadResult:
    """``get_many(keys)`` of a one-node store as a `ReadResult`: its failure is
    the node's (every key ``NOT_READ``), never raised; ConfigError (for the user to fix,
    e.g. no password in this process) is."""
    node = client.node_names[0]
    if node in skip:
        return ReadResult([NOT_READ] * len(keys), skipped=len(keys))
    try:
        values: list[Any] = list(await get_many(keys))
    except StoreError as exc:
        return ReadResult([NOT_READ] * len(keys), failures={node: exc})
    except ConfigError:
        raise
    except Exception as exc:  # a provider bug must not stop training either
        return ReadResult([NOT_READ] * len(keys), failures={node: _foreign(client, exc)})
    return ReadResult(values, answered=[node])


async def write_one_node(client: BaseClient[Any],
                         set_many: Callable[[Mapping[bytes, bytes], float | None],
                                            Awaitable[None]],
                         entries: Mapping[bytes, bytes], ttl: float | None,
                         skip: Collection[NodeName]) -> WriteResult:
    """``set_many(entries, ttl)`` of a one-node store as a `WriteResult`."""
    node = client.node_names[0]
    if node in skip:
        return WriteResult(skipped=len(entries))
    try:
        await set_many(entries, ttl)
    except StoreError as exc:
        return WriteResult(failures={node: exc}, failed_keys=len(entries))
    except ConfigError:
        raise
    except Exception as exc:
        return WriteResult(failures={node: _foreign(client, exc)}, failed_keys=len(entries))
    return WriteResult(written=len(entries), answered=[node])


def _foreign(client: BaseClient[Any], exc: Exception) -> StoreError:
    error = StoreError(f"{client.safe_url}: the store client raised {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def chunked(seq: Sequence[T], size: int) -> list[Sequence[T]]:
    """``seq`` cut into consecutive slices of at most ``size`` items."""
    return [seq[i : i + size] for i in range(0, len(seq), size)]
