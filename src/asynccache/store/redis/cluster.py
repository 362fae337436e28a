"""Redis Cluster on the lean RESP path: redis-py keeps the slot map, every byte of data
goes over one pipelined :class:`~asynccache.store.redis.connection.RespConnection` per primary.

Why not redis-py for the data: ``mget_nonatomic`` sends one command per hash slot through
redis-py's per-command Python path. A batch of keys touches about as many slots as it has
keys, so that path *is* the cost of a read (measured: 51k–67k items/s on a 3-node
cluster against 500k+ on one server). Here each node gets one pipelined exchange of
``MGET``s (one per slot and per ``max_batch`` keys) or ``SET``s (one per key, so the
server answers each key), and all nodes are asked concurrently.

Topology: ``redis.asyncio.cluster.RedisCluster`` is kept only as the slot map (``CLUSTER
SLOTS``, node naming, ``key_slot``); it carries no data. A key's slot is the server's
CRC16 of the key (of its ``{tag}`` if it has one; asynccache never adds tags, which would
pile a dataset onto one node).

Redirections, within the same call: ``MOVED`` (the slot has a new owner) refreshes the
slot map and, concurrently, sends those keys once more to the node the reply names;
``ASK`` (the slot is being migrated and the key is not on the source any more) sends
them once more to the named node, each command preceded by ``ASKING``. A second
redirection for the same keys is a failure: they are not read.

Failures are per node (``ReadResult.failures["host:port"]``), so one dead primary costs
only its own keys: its keys are ``NOT_READ`` (reads) or counted in ``failed_keys``
(writes) while the other nodes' keys are served. A node that does not answer also
triggers a background re-read of the slot map (at most one per second), which is how a
failover to a replica is found. The live nodes keep serving only while the servers
themselves do: a cache cluster wants ``cluster-require-full-coverage no``, otherwise the
live nodes answer ``CLUSTERDOWN`` for every key once the dead node is marked failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from binascii import crc_hqx
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis
import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from ...errors import CacheError, StoreError, StoreRejected, StoreTimeout, StoreUnavailable
from ..api import (
    NOT_READ,
    BaseClient,
    ConsumerConnection,
    ConsumerReads,
    NodeName,
    ReadResult,
    WriteResult,
    chunked,
)
from ..credentials import Credential
from ..loop import LoopThread, get_loop_thread
from ..protocol.resp import (
    PING,
    check_mget_reply,
    cluster_node_error,
    explain_rejection,
    is_error,
    memcached_hint,
    pack_command,
    pack_delete,
    pack_gets,
    pack_mget,
    pack_set,
    pack_set_if_absent,
)
from ..transport.endpoint import connect_failure
from ..transport.tls import TlsSettings, ssl_error_in
from .admin import node_info, pack_exists, pack_strlen, scan_node, size_of
from .cluster_reads import BlockingClusterConnection, UnservedKeys
from .connection import Request, RespConnection
from .endpoint import RedisEndpoint

__all__ = ["RedisClusterClient"]

logger = logging.getLogger("asynccache")

_ASKING = pack_command(b"ASKING")
#: Least seconds between slot-map re-reads triggered by a node that did not answer: a dead
#: node is probed on every read that is not skipped, and each probe must not cost a
#: ``CLUSTER SLOTS``.
REFRESH_INTERVAL = 1.0
#: Least seconds between re-reads asked for by a redirection the consumer-side path saw
#: (it cannot follow one itself): a burst of ``MOVED`` replies costs one ``CLUSTER SLOTS``.
REDIRECT_REFRESH_INTERVAL = 0.1
_SLOT_MASK = REDIS_CLUSTER_HASH_SLOTS - 1
_ReplyError = hiredis.ReplyError


def key_slots(keys: Sequence[bytes]) -> list[int]:
    """Each key's hash slot: redis-py's ``key_slot`` (the server's CRC16, of the ``{tag}``
    when there is one), with the common tag-free batch inlined (``binascii.crc_hqx`` is
    the C CRC16 that ``key_slot`` itself calls)."""
    if b"{" in b"".join(keys):
        return [key_slot(k) for k in keys]
    return [crc_hqx(k, 0) & _SLOT_MASK for k in keys]


@dataclass(frozen=True, slots=True)
class _SlotView:
    """redis-py's slot map as of one refresh, flattened for lookups on the hot path (and
    replaced whole, so the consumer threads read a consistent one without a lock):
    ``owners[slot]`` is the primary's name (None: no node serves the slot)."""

    generation: int
    owners: tuple[str | None, ...]
    primaries: dict[str, tuple[str, int]]  # name -> (host, port)


_NO_VIEW = _SlotView(0, (None,) * REDIS_CLUSTER_HASH_SLOTS, {})


@dataclass(slots=True)
class _Command:
    """One command about keys of one slot; ``positions`` index the caller's keys."""

    slot: int
    positions: list[int]
    request: Request


@dataclass(frozen=True, slots=True)
class _Target:
    """A node to send commands to: the slot's owner in the map, or where a ``MOVED`` /
    ``ASK`` reply sends them (``asking``: each command goes after an ``ASKING``)."""

    node: str  # "host:port": the name failures are reported under
    host: str
    port: int
    asking: bool = False


@dataclass
class _ClusterState:
    topology: RedisCluster  # the slot map only: no data goes through redis-py
    nodes: dict[str, RespConnection] = field(default_factory=dict)  # "host:port" -> conn
    ready: bool = False  # the slot map was read once
    view: _SlotView = _NO_VIEW  # the slot map as of the last read
    refresh: asyncio.Task[None] | None = None  # background re-read after a failure
    last_refresh: float = float("-inf")  # time.monotonic() of the last re-read started


def _redirect(reply: Any, replier_host: str) -> _Target | None:
    """The target of a ``MOVED slot host:port`` / ``ASK slot host:port`` reply, else None
    (a malformed one included: it then fails as any other error reply).

    An empty host means "the host you reached me on" (a node that does not know its
    own address).
    """
    text = str(reply)
    if not text.startswith(("MOVED ", "ASK ")):
        return None
    kind, _, rest = text.partition(" ")
    address = rest.partition(" ")[2]
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    host = host or replier_host
    return _Target(f"{host}:{port}", host, int(port), asking=kind == "ASK")


def _unexpected(node: str, exc: Exception) -> StoreError:
    """A bug below us must cost the node's keys, not the training run."""
    error = StoreError(f"redis cluster node {node}: the client raised "
                       f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class _Call(ABC):
    """One operation across the cluster: commands grouped by owning node, one pipelined
    exchange per node, nodes concurrently, ``MOVED``/``ASK`` followed once.

    What went wrong is recorded per node and never raised; subclasses turn the replies
    into values or counts.
    """

    def __init__(self, client: RedisClusterClient, state: _ClusterState,
                 skip: Collection[NodeName]) -> None:
        self.client = client
        self.state = state
        self.skip = skip
        self.failures: dict[str, StoreError] = {}
        self.replied: dict[str, None] = {}  # nodes that answered, in order
        self.failed_keys = 0
        self.skipped = 0
        self.refresh_soon = False  # a node did not answer: the map may be stale

    @abstractmethod
    def on_reply(self, node: str, command: _Command, reply: Any) -> None:
        """A reply that is neither a redirection nor a node-level error."""

    @property
    def answered(self) -> list[str]:
        return [node for node in self.replied if node not in self.failures]

    def fail(self, node: str, error: StoreError, commands: Sequence[_Command] | int) -> None:
        """``node`` failed for ``commands`` (or that many keys)."""
        self.failures.setdefault(node, error)
        self.failed_keys += (commands if type(commands) is int
                             else sum(len(c.positions) for c in commands))  # type: ignore[union-attr]
        if isinstance(error, StoreUnavailable | StoreTimeout):
            self.refresh_soon = True

    async def run(self, commands: Sequence[_Command]) -> None:
        redirects: list[tuple[_Command, _Target]] = []
        await asyncio.gather(*(self._exchange(target, cmds, redirects)
                               for target, cmds in self._route(commands).values()))
        if redirects:
            await self._follow(redirects)
        if self.refresh_soon:
            self.client._refresh_soon(self.state)

    def _route(self, commands: Sequence[_Command]
               ) -> dict[str, tuple[_Target, list[_Command]]]:
        """Commands grouped by the node owning their slot in the map (keyed by node name:
        a str hashes once, a ClusterNode in Python on every lookup); a slot no node
        serves fails its keys under the cluster's URL."""
        owner_of = self.state.topology.nodes_manager.get_node_from_slot
        groups: dict[str, tuple[_Target, list[_Command]]] = {}
        for command in commands:
            try:
                owner = owner_of(command.slot)
            except (rexc.SlotNotCoveredError, KeyError):  # redis-py 8 lets a KeyError out
                url = self.client.safe_url
                self.fail(url, StoreUnavailable(
                    f"slot {command.slot} of redis cluster {url} is served by no node"),
                    [command])
                continue
            group = groups.get(owner.name)
            if group is None:
                group = (_Target(owner.name, owner.host, int(owner.port)), [])
                groups[owner.name] = group
            group[1].append(command)
        return groups

    async def _follow(self, redirects: list[tuple[_Command, _Target]]) -> None:
        """Send redirected commands once more, to the named nodes; after a ``MOVED``,
        re-read the slot map at the same time (the retry does not need it)."""
        again: dict[_Target, list[_Command]] = {}
        for command, target in redirects:
            again.setdefault(target, []).append(command)
        moved = any(not target.asking for target in again)
        await asyncio.gather(
            *([self.client._refresh(self.state)] if moved else []),
            *(self._exchange(target, cmds, None) for target, cmds in again.items()))

    async def _exchange(self, target: _Target, commands: list[_Command],
                        redirects: list[tuple[_Command, _Target]] | None) -> None:
        """One node's commands, pipelined; ``redirects`` collects MOVED/ASK replies (None
        on a retry: a second redirection fails those keys)."""
        node, asking = target.node, target.asking
        if node in self.skip:
            self.skipped += sum(len(c.positions) for c in commands)
            return
        conn = self.client._connection(self.state, target)
        if asking:
            requests: list[Request] = []
            for command in commands:
                requests += ([_ASKING], command.request)
        else:
            requests = [command.request for command in commands]
        try:
            replies = await conn.execute(requests)
        except StoreError as exc:
            self.fail(node, exc, commands)
            return
        except Exception as exc:
            self.fail(node, _unexpected(node, exc), commands)
            return
        if asking:
            replies = replies[1::2]  # ASKING answers OK; a refused one shows in the next reply
        self.replied[node] = None
        for command, reply in zip(commands, replies):
            self.handle(target, command, reply, redirects)

    def handle(self, target: _Target, command: _Command, reply: Any,
               redirects: list[tuple[_Command, _Target]] | None) -> None:
        """One reply: a redirection is collected (or, on a retry, fails), an error about
        the node fails its keys, anything else goes to :meth:`on_reply`."""
        node = target.node
        if is_error(reply):
            moved = _redirect(reply, target.host)
            if moved is not None:
                if redirects is None:
                    self.fail(node, StoreError(
                        f"redis cluster node {node} redirected slot {command.slot} "
                        f"again ({reply}) after a redirection; its keys were not served"),
                        [command])
                else:
                    redirects.append((command, moved))
                return
            error = cluster_node_error(reply, node)
            if error is not None:
                self.fail(node, error, [command])
                return
        self.on_reply(node, command, reply)


class _Read(_Call):
    """A read: per node, one pipelined exchange of a ``GET`` per key (an ``MGET`` per slot
    for a slot holding several keys of the batch), parsed in one pass; only the rare
    error replies become :class:`_Command` s, for the redirection and failure logic."""

    def __init__(self, client: RedisClusterClient, state: _ClusterState,
                 skip: Collection[NodeName], n: int) -> None:
        super().__init__(client, state, skip)
        self.values: list[Any] = [NOT_READ] * n

    async def read(self, keys: Sequence[bytes]) -> None:
        slots = key_slots(keys)
        owners = self.state.view.owners
        groups: dict[str | None, list[int]] = {}
        distinct = len(set(slots)) == len(slots)  # no slot with two keys (most batches)
        for position, node in enumerate([owners[slot] for slot in slots]):
            group = groups.get(node)
            if group is None:
                groups[node] = [position]
            else:
                group.append(position)
        unserved = groups.pop(None, None)
        if unserved is not None:
            url = self.client.safe_url
            self.fail(url, StoreUnavailable(
                f"slot {slots[unserved[0]]} of redis cluster {url} is served by no node"),
                len(unserved))
        # every node's request is written first, then the replies are awaited in turn:
        # the nodes work concurrently without a Task per node
        redirects: list[tuple[_Command, _Target]] = []
        primaries = self.state.view.primaries
        sent: list[tuple[_Target, list[int], list[_Command] | None, RespConnection, Any]] = []
        for node, positions in groups.items():
            if node in self.skip:
                self.skipped += len(positions)
                continue
            host, port = primaries[node]  # type: ignore[index]
            target = _Target(node, host, port)  # type: ignore[arg-type]
            try:
                commands, data, n = self._pack(keys, slots, positions, distinct)
                conn = self.client._connection(self.state, target)
                exchange: Any = conn.send_now((data,), n)
                if exchange is None:  # not connected yet: connect (and send) in a Task
                    exchange = asyncio.ensure_future(conn.execute_packed((data,), n))
            except Exception as exc:  # a bug below us costs this node's keys
                self.fail(node, _unexpected(node, exc), len(positions))
                continue
            sent.append((target, positions, commands, conn, exchange))
        try:
            while sent:
                target, positions, commands, conn, exchange = sent.pop(0)
                node = target.node
                try:
                    if isinstance(exchange, asyncio.Future):
                        replies = await exchange
                    else:
                        replies = await conn.result(exchange)
                    self.replied[node] = None
                    self._scatter(target, keys, slots, positions, commands, replies, redirects)
                except StoreError as exc:
                    self.fail(node, exc, len(positions))
                except Exception as exc:
                    self.fail(node, _unexpected(node, exc), len(positions))
        finally:
            for *_, exchange in sent:  # cancelled: nobody waits for these replies any more
                exchange.cancel()
        if redirects:
            await self._follow(redirects)
        if self.refresh_soon:
            self.client._refresh_soon(self.state)

    def _pack(self, keys: Sequence[bytes], slots: list[int], positions: list[int],
              distinct: bool) -> tuple[list[_Command] | None, bytes, int]:
        """One node's request: a GET per key (commands None), or, when a slot holds
        several of its keys, a GET per lone key and an MGET per such slot."""
        if distinct:  # the common case
            return None, pack_gets([keys[p] for p in positions]), len(positions)
        commands = []
        by_slot: dict[int, list[int]] = {}
        for position in positions:
            by_slot.setdefault(slots[position], []).append(position)
        for slot, at in by_slot.items():
            if len(at) == 1:
                commands.append(_Command(slot, at, [pack_gets((keys[at[0]],))]))
            else:
                commands += [_Command(slot, chunk, [pack_mget([keys[p] for p in chunk])])
                             for chunk in chunked(at, self.client.max_batch)]
        return commands, b"".join([c.request[0] for c in commands]), len(commands)  # type: ignore[misc]

    def _scatter(self, target: _Target, keys: Sequence[bytes], slots: list[int],
                 positions: list[int], commands: list[_Command] | None, replies: list[Any],
                 redirects: list[tuple[_Command, _Target]]) -> None:
        """A node's replies into the values; error replies to :meth:`handle`."""
        values = self.values
        if commands is None:
            if _ReplyError not in map(type, replies):
                for position, value in zip(positions, replies):
                    values[position] = value
                return
            commands = [_Command(slots[p], [p], []) for p in positions]
        for command, reply in zip(commands, replies):
            if len(command.positions) == 1 and type(reply) is not list:  # a GET's reply
                if type(reply) is not _ReplyError:
                    values[command.positions[0]] = reply
                    continue
                # a retry (after MOVED / ASK) goes as an MGET of one key
                command.request = [pack_mget((keys[command.positions[0]],))]
            self.handle(target, command, reply, redirects)

    def on_reply(self, node: str, command: _Command, reply: Any) -> None:
        if type(reply) is not list:
            try:
                check_mget_reply(reply, f"cluster node {node}")
            except StoreError as exc:
                self.fail(node, exc, [command])
            return
        values = self.values
        for position, value in zip(command.positions, reply):
            values[position] = value


class _Write(_Call):
    def __init__(self, client: RedisClusterClient, state: _ClusterState,
                 skip: Collection[NodeName], items: Sequence[tuple[bytes, bytes]]) -> None:
        super().__init__(client, state, skip)
        self.items = items
        self.written = 0
        self.rejected: dict[bytes, StoreError] = {}

    def on_reply(self, node: str, command: _Command, reply: Any) -> None:
        if not is_error(reply):
            self.written += 1
            return
        key, value = self.items[command.positions[0]]
        size = memoryview(value).nbytes
        self.rejected[key] = StoreRejected(
            explain_rejection(reply, f"cluster node {node}", size))


class _Add(_Call):
    """``SET NX PX`` per key: which keys were absent (and are now set)."""

    def __init__(self, client: RedisClusterClient, state: _ClusterState, n: int) -> None:
        super().__init__(client, state, ())
        self.added = [False] * n

    def on_reply(self, node: str, command: _Command, reply: Any) -> None:
        if is_error(reply):
            self.fail(node, StoreError(f"redis cluster node {node} refused SET NX: {reply}"),
                      [command])
            return
        self.added[command.positions[0]] = reply is not None


class _Delete(_Call):
    def on_reply(self, node: str, command: _Command, reply: Any) -> None:
        if is_error(reply):
            self.fail(node, StoreError(f"redis cluster node {node} refused DEL: {reply}"),
                      [command])


class _Exists(_Call):
    """``EXISTS`` per key: which keys the cluster holds."""

    def __init__(self, client: RedisClusterClient, state: _ClusterState, n: int) -> None:
        super().__init__(client, state, ())
        self.found = [False] * n

    def on_reply(self, node: str, command: _Command, reply: Any) -> None:
        if is_error(reply):
            self.fail(node, StoreError(f"redis cluster node {node} refused EXISTS: {reply}"),
                      [command])
            return
        self.found[command.positions[0]] = reply == 1


class _Sizes(_Call):
    """``STRLEN`` per key: the sizes of the values the cluster holds."""

    def __init__(self, client: RedisClusterClient, state: _ClusterState, n: int) -> None:
        super().__init__(client, state, ())
        self.sizes: list[int | None] = [None] * n

    def on_reply(self, node: str, command: _Command, reply: Any) -> None:
        try:
            self.sizes[command.positions[0]] = size_of(reply, f"cluster node {node}")
        except StoreError as exc:
            self.fail(node, exc, [command])


class RedisClusterClient(BaseClient[_ClusterState]):
    """Client for a Redis Cluster given one or more startup nodes."""

    scheme = "redis+cluster"
    max_value_size = 512 * 1024 * 1024

    def __init__(
        self,
        *,
        nodes: Sequence[tuple[str, int]],
        username: str | None = None,
        password: str | None = None,
        password_env: str | None = None,
        ssl: bool = False,
        tls: TlsSettings | None = None,
        **options: Any,
    ) -> None:
        """Credentials and TLS as for :class:`~asynccache.store.redis.client.RedisClient`; the
        slot map (redis-py) and the data connections use the same settings."""
        options.setdefault("max_batch", 512)
        super().__init__(**options)
        self.nodes = [(str(h), int(p)) for h, p in nodes]
        self.username = username
        self.tls = tls if tls is not None or not ssl else TlsSettings()
        self._credential = Credential.keep(self.safe_url, password, password_env)

    @property
    def ssl(self) -> bool:
        return self.tls is not None

    def _init_runtime(self) -> None:
        super()._init_runtime()
        #: the primaries of the latest slot map this process read (see node_names)
        self._primaries: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_primaries", None)
        return state

    @property
    def safe_url(self) -> str:
        auth = f"{self.username or ''}:***@" if self._credential else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://{auth}{hosts}"

    @property
    def node_names(self) -> tuple[str, ...]:
        """The primaries (``host:port``) of the latest slot map read in this process; the
        startup nodes until one was read. A failure before any map was read (no startup
        node answers) is reported under :attr:`safe_url`."""
        return self._primaries or tuple(f"{h}:{p}" for h, p in self.nodes)

    # -- per-loop state: the slot map and one connection per primary -------------------
    def _open_state(self) -> _ClusterState:
        topology = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
            # a slot nobody serves costs its own keys, not the whole map
            require_full_coverage=False,
            username=self.username,
            password=self.password,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.connect_timeout,
            **(self.tls.redis_py_options() if self.tls else {}),
        )
        return _ClusterState(topology)

    async def _close_state(self, state: _ClusterState) -> None:
        if state.refresh is not None:
            state.refresh.cancel()
            await asyncio.gather(state.refresh, return_exceptions=True)
        for conn in state.nodes.values():
            conn.close()
        state.nodes.clear()
        await state.topology.aclose()

    def _endpoint(self, host: str, port: int) -> RedisEndpoint:
        return RedisEndpoint(
            host=host, port=port, unix_socket_path=None, username=self.username,
            password=self.password, db=0, timeout=self.timeout,
            connect_timeout=self.connect_timeout, where=f"cluster node {host}:{port}",
            tls=self.tls)

    def _connection(self, state: _ClusterState, target: _Target) -> RespConnection:
        """The node's connection. Every primary of the map has one; a redirection may
        name a node the map does not list yet, whose connection is closed at the next
        map refresh unless it is a primary by then."""
        conn = state.nodes.get(target.node)
        if conn is None:
            conn = RespConnection(self._endpoint(target.host, target.port))
            state.nodes[target.node] = conn
        return conn

    def _sync_nodes(self, state: _ClusterState) -> None:
        """One connection per primary of the current map; close the others. Publish the
        map as a new :class:`_SlotView` (the read paths' lookups)."""
        primaries = {n.name: n for n in state.topology.get_primaries()}
        for name in [name for name in state.nodes if name not in primaries]:
            state.nodes.pop(name).close()
        for name, node in primaries.items():
            if name not in state.nodes:
                state.nodes[name] = RespConnection(self._endpoint(node.host, int(node.port)))
        owners: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        for slot, holders in state.topology.nodes_manager.slots_cache.items():
            if holders and holders[0].name in primaries:  # [0]: the slot's primary
                owners[slot] = holders[0].name
        state.view = _SlotView(state.view.generation + 1, tuple(owners),
                               {name: (n.host, int(n.port)) for name, n in primaries.items()})
        self._primaries = tuple(primaries)

    async def _load_map(self, state: _ClusterState) -> None:
        """Read the slot map (``CLUSTER SLOTS`` from the first startup node that answers);
        raises StoreError when none does."""
        budget = self.connect_timeout + self.timeout
        try:
            if state.ready:
                await asyncio.wait_for(state.topology.nodes_manager.initialize(), budget)
            else:
                await asyncio.wait_for(state.topology.initialize(), budget)
        except asyncio.TimeoutError as exc:
            raise StoreTimeout(f"redis cluster {self.safe_url} did not give its slot map "
                               f"within {budget:g}s") from exc
        except (rexc.RedisError, rexc.RedisClusterException, OSError) as exc:
            # RedisClusterException ("cannot be connected") is not a RedisError
            tls_error = ssl_error_in(exc)
            if tls_error is not None:  # say what TLS refused, not only "cannot connect"
                raise connect_failure("redis cluster", self.safe_url, tls_error, self.tls,
                                      self.connect_timeout) from exc
            hint = memcached_hint(exc, None)
            raise StoreUnavailable(f"cannot read the slot map of redis cluster "
                                   f"{self.safe_url}: {exc}{'; ' if hint else ''}{hint}"
                                   ) from exc
        state.ready = True
        self._sync_nodes(state)

    async def _refresh(self, state: _ClusterState) -> None:
        """Re-read the slot map; a failure only leaves the old map in place (logged)."""
        state.last_refresh = time.monotonic()
        try:
            await self._load_map(state)
        except StoreError as exc:
            logger.debug("asynccache: slot map refresh failed: %s", exc)

    def _refresh_soon(self, state: _ClusterState, interval: float = REFRESH_INTERVAL) -> None:
        """Re-read the map in the background, at most once per ``interval``."""
        if state.refresh is not None and not state.refresh.done():
            return
        if time.monotonic() - state.last_refresh < interval:
            return
        state.refresh = asyncio.ensure_future(self._refresh(state))

    def _consumer_trouble(self, redirected: bool) -> None:
        """(Loop thread.) A consumer-side connection saw a redirection, or a node that
        cannot serve: re-read the map soon (the consumers' routing follows it)."""
        try:
            state = self._state()
        except RuntimeError:  # the loop is shutting down
            return
        self._refresh_soon(state, REDIRECT_REFRESH_INTERVAL if redirected else REFRESH_INTERVAL)

    async def _loaded_state(self) -> _ClusterState:
        """(Loop thread.) This loop's state, its map read if any startup node answers."""
        state = self._state()
        if not state.ready:
            try:
                await self._load_map(state)
            except StoreError as exc:
                logger.debug("asynccache: slot map not read yet: %s", exc)
        return state

    def consumer_reads(self) -> ConsumerReads | None:
        """Read-ahead on the consumer thread's own sockets: one blocking connection per
        primary (TLS as configured), routed by the slot map of the process's loop
        thread, which keeps it fresh (see :class:`_ConsumerRoutes`)."""
        loop = get_loop_thread()
        if loop.in_loop_thread():
            return None
        try:
            loop.call(self._loaded_state(), self.connect_timeout + self.timeout + 1)
        except (concurrent.futures.TimeoutError, CacheError):
            pass  # no map yet: the routes send every key to UnservedKeys until one is read
        routes = _ConsumerRoutes(self, loop)
        return ConsumerReads(routes.conns, routes.route,
                             fanout=max(1, len(self.node_names)))

    async def _ready(self) -> _ClusterState:
        state = self._state()
        if not state.ready:
            await self._load_map(state)
        return state

    @staticmethod
    def _by_slot(keys: Sequence[bytes]) -> dict[int, list[int]]:
        slots: dict[int, list[int]] = {}
        for position, slot in enumerate(key_slots(keys)):
            found = slots.get(slot)
            if found is None:
                slots[slot] = [position]
            else:
                found.append(position)
        return slots

    def _multi_key(self, keys: Sequence[bytes],
                   pack: Callable[[Sequence[bytes]], bytes]) -> list[_Command]:
        """One command per slot and per ``max_batch`` keys (a multi-key command must stay
        within one slot). Most slots of a batch hold one key: that case is kept cheap."""
        commands = []
        limit = self.max_batch
        for slot, positions in self._by_slot(keys).items():
            if len(positions) == 1:
                commands.append(_Command(slot, positions, [pack((keys[positions[0]],))]))
                continue
            for chunk in chunked(positions, limit):
                commands.append(_Command(slot, chunk, [pack([keys[p] for p in chunk])]))
        return commands

    # -- what the core calls ------------------------------------------------------------
    async def read(self, keys: Sequence[bytes], skip: Collection[NodeName] = ()) -> ReadResult:
        if self.safe_url in skip:
            return ReadResult([NOT_READ] * len(keys), skipped=len(keys))
        try:
            state = await self._ready()
        except StoreError as exc:
            return ReadResult([NOT_READ] * len(keys), failures={self.safe_url: exc})
        call = _Read(self, state, skip, len(keys))
        if keys:
            await call.read(keys)
        return ReadResult(call.values, call.failures, call.answered, call.skipped)

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        if self.safe_url in skip:
            return WriteResult(skipped=len(entries))
        try:
            state = await self._ready()
        except StoreError as exc:
            return WriteResult(failures={self.safe_url: exc}, failed_keys=len(entries))
        items = list(entries.items())
        call = _Write(self, state, skip, items)
        if items:
            ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
            await call.run([_Command(key_slot(key), [i], pack_set(key, value, ttl_ms))
                            for i, (key, value) in enumerate(items)])
        return WriteResult(call.written, call.failures, call.failed_keys, call.rejected,
                           call.answered, call.skipped)

    # -- all or nothing -----------------------------------------------------------------
    async def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        call = _Delete(self, await self._ready(), ())
        await call.run(self._multi_key(keys, pack_delete))
        for error in call.failures.values():
            raise error

    async def ping(self) -> None:
        """``PING`` every primary of the slot map, concurrently."""
        state = await self._ready()
        primaries = [_Target(n.name, n.host, int(n.port))
                     for n in state.topology.get_primaries()]
        replies = await asyncio.gather(
            *(self._connection(state, target).execute([[PING]]) for target in primaries),
            return_exceptions=True)
        for target, reply in zip(primaries, replies):
            if isinstance(reply, BaseException):
                raise reply
            if is_error(reply[0]):
                raise StoreError(f"redis cluster node {target.node} answered PING with "
                                 f"{reply[0]}")

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        items = list(entries.items())
        call = _Add(self, await self._ready(), len(items))
        ttl_ms = max(1, int(ttl * 1000))
        await call.run([_Command(key_slot(key), [i], pack_set_if_absent(key, value, ttl_ms))
                        for i, (key, value) in enumerate(items)])
        for error in call.failures.values():
            raise error
        return call.added

    # -- administration -------------------------------------------------------------------
    async def _primaries_now(self) -> tuple[_ClusterState, list[_Target]]:
        state = await self._ready()
        return state, [_Target(n.name, n.host, int(n.port))
                       for n in state.topology.get_primaries()]

    async def server_info(self) -> dict[str, Any]:
        """Every primary's server, version, item size and memory, concurrently."""
        state, primaries = await self._primaries_now()
        infos = await asyncio.gather(*(node_info(self._connection(state, t), t.node)
                                       for t in primaries))
        return {"max_value_size": self.max_value_size,
                "nodes": {t.node: info for t, info in zip(primaries, infos)}}

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        """``SCAN MATCH`` on every primary in turn (each holds only its own slots)."""
        state, primaries = await self._primaries_now()
        for target in primaries:
            conn = self._connection(state, target)
            async for page in scan_node(conn, prefix, batch, f"cluster node {target.node}"):
                yield page

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``EXISTS`` per key, pipelined per owning node, nodes concurrently."""
        call = _Exists(self, await self._ready(), len(keys))
        if keys:
            await call.run([_Command(key_slot(key), [i], [pack_exists(key)])
                            for i, key in enumerate(keys)])
        for error in call.failures.values():
            raise error
        return call.found

    async def sizes_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """``STRLEN`` per key, pipelined per owning node, nodes concurrently."""
        call = _Sizes(self, await self._ready(), len(keys))
        if keys:
            await call.run([_Command(key_slot(key), [i], [pack_strlen(key)])
                            for i, key in enumerate(keys)])
        for error in call.failures.values():
            raise error
        return call.sizes


class _ConsumerRoutes:
    """``route(keys)`` for one consumer thread's reader (read-ahead on its own sockets),
    and its connections: one :class:`BlockingClusterConnection` per primary.

    The map is the one the loop thread's state keeps (redis-py's, as a
    :class:`_SlotView`); each request looks at its generation, and a new one (after a
    ``MOVED``, a failover, a node that left) is followed there and then: connections of
    nodes that left the map are closed and given to the nodes that joined it. The list
    of connections cannot grow once handed out (the source sized its state by it), so it
    holds spares: twice as many as there are primaries now (at least six). Keys of a
    slot no node serves, of a node no spare is left for, or all keys while no map could
    be read yet, go to :class:`UnservedKeys`: the asyncio path reads them (loading the
    map if need be), and what fails there fails only them.
    """

    def __init__(self, client: RedisClusterClient, loop: LoopThread) -> None:
        self.client = client
        self.loop = loop
        capacity = 2 * max(len(client.node_names), 3)
        self.conns: list[ConsumerConnection] = [
            BlockingClusterConnection(None, f"(spare {i})", self.trouble)
            for i in range(capacity)]
        self.unserved = capacity
        self.conns.append(UnservedKeys(self._unserved_name, self._read_on_loop))
        self.generation = -1
        self.owner_of: list[int] = [self.unserved] * REDIS_CLUSTER_HASH_SLOTS
        self.incomplete = False  # a primary of the map is still without a connection

    def trouble(self, node: str, redirected: bool) -> None:
        """(Consumer thread.) Ask the loop thread to re-read the map."""
        try:
            self.loop.call_soon(self.client._consumer_trouble, redirected)
        except RuntimeError:  # the loop is closed: nothing to refresh for
            pass

    def _unserved_name(self) -> str:
        """Where keys without a connection count their failures: the cluster's URL
        before any map was read (as the asyncio path reports it), else the slots no
        node serves."""
        state = self.client._states.get(self.loop.loop)
        url = self.client.safe_url
        if state is None or state.view is _NO_VIEW:
            return url
        return f"{url} (slots no node serves)"

    def _read_on_loop(self, keys: Sequence[bytes]) -> list[Any]:
        """(Consumer thread.) ``keys`` read by the asyncio path; raises what failed."""
        client = self.client
        budget = client.connect_timeout + 2 * client.timeout + 1
        try:
            result = self.loop.call(client.read(list(keys)), budget)
        except concurrent.futures.TimeoutError as exc:
            raise StoreTimeout(f"redis cluster {client.safe_url} did not answer within "
                               f"{budget:g}s") from exc
        except RuntimeError as exc:  # the loop is closed
            raise StoreUnavailable(f"redis cluster {client.safe_url}: {exc}") from exc
        for error in result.failures.values():
            raise error
        if result.skipped:  # not skipped here: only the policy skips, before send_get
            raise StoreError("keys skipped by the cluster client (asynccache bug)")
        return result.values

    def _view(self) -> _SlotView | None:
        state = self.client._states.get(self.loop.loop)
        return None if state is None else state.view

    def route(self, keys: Sequence[bytes]) -> list[tuple[int, list[int]]]:
        view = self._view()
        if view is not None and (view.generation != self.generation or (
                self.incomplete and self._any_free(view))):
            self._follow(view)
        owner_of = self.owner_of
        groups: dict[int, list[int]] = {}
        for position, ci in enumerate([owner_of[slot] for slot in key_slots(keys)]):
            group = groups.get(ci)
            if group is None:
                groups[ci] = [position]
            else:
                group.append(position)
        return list(groups.items())

    def _real(self) -> list[BlockingClusterConnection]:
        return self.conns[: self.unserved]  # type: ignore[return-value]

    def _any_free(self, view: _SlotView) -> bool:
        return any(c.endpoint is None or (c.node not in view.primaries and not c.pending)
                   for c in self._real())

    def _follow(self, view: _SlotView) -> None:
        """Connections for the primaries of ``view``, and the slot → connection lookup."""
        primaries = view.primaries
        conns = self._real()
        index = {c.node: ci for ci, c in enumerate(conns)
                 if c.endpoint is not None and c.node in primaries}
        free = []
        for ci, conn in enumerate(conns):
            if conn.endpoint is None or (conn.node not in primaries and not conn.pending):
                conn.close()
                free.append(ci)
        self.incomplete = False
        for name, (host, port) in primaries.items():
            if name in index:
                continue
            if not free:
                self.incomplete = True
                logger.debug("asynccache: no consumer connection left for cluster node %s",
                             name)
                continue
            ci = free.pop(0)
            conns[ci].retarget(self.client._endpoint(host, port), name)
            index[name] = ci
        unserved = self.unserved
        lookup = {name: index.get(name, unserved) for name in primaries}
        self.owner_of = [unserved if name is None else lookup[name] for name in view.owners]
        self.generation = view.generation
