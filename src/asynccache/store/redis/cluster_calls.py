"""One operation across a Redis Cluster (read, write, add, delete, exists, sizes):
commands grouped by owning node, one pipelined exchange per node, nodes concurrently,
``MOVED``/``ASK`` followed once, failures reported per node."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import Any, Generic, TypeVar

import hiredis
import redis.exceptions as rexc

from ...errors import StoreError, StoreRejected, StoreTimeout, StoreUnavailable
from ..api import NOT_READ, NodeName, chunked
from ..protocol.resp import (
    check_mget_reply,
    cluster_node_error,
    explain_rejection,
    is_error,
    pack_command,
    pack_gets,
    pack_mget,
)
from .cluster_map import ClusterMap
from .cluster_slots import Command, Target, key_slots
from .connection import Request, RespConnection

T = TypeVar("T")

__all__ = ["Delete", "PerKey", "Read", "Write", "added", "exists"]

_ASKING = pack_command(b"ASKING")
_ReplyError = hiredis.ReplyError


def _redirect(reply: Any, replier_host: str) -> Target | None:
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
    return Target(NodeName(f"{host}:{port}"), host, int(port), asking=kind == "ASK")


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

    def __init__(self, cmap: ClusterMap, skip: Collection[NodeName]) -> None:
        self.cmap = cmap
        self.skip = skip
        self.failures: dict[NodeName, StoreError] = {}
        self.replied: dict[NodeName, None] = {}  # nodes that answered, in order
        self.failed_keys = 0
        self.skipped = 0
        self.refresh_soon = False  # a node did not answer: the map may be stale

    @abstractmethod
    def on_reply(self, node: NodeName, command: Command, reply: Any) -> None:
        """A reply that is neither a redirection nor a node-level error."""

    @property
    def answered(self) -> list[NodeName]:
        return [node for node in self.replied if node not in self.failures]

    def fail(self, node: NodeName, error: StoreError, commands: Sequence[Command] | int) -> None:
        """``node`` failed for ``commands`` (or that many keys)."""
        self.failures.setdefault(node, error)
        self.failed_keys += (commands if isinstance(commands, int)
                             else sum(len(c.positions) for c in commands))
        if isinstance(error, StoreUnavailable | StoreTimeout):
            self.refresh_soon = True

    async def run(self, commands: Sequence[Command]) -> None:
        redirects: list[tuple[Command, Target]] = []
        await asyncio.gather(*(self._exchange(target, cmds, redirects)
                               for target, cmds in self._route(commands).values()))
        if redirects:
            await self._follow(redirects)
        if self.refresh_soon:
            self.cmap.refresh_soon()

    def _route(self, commands: Sequence[Command]
               ) -> dict[str, tuple[Target, list[Command]]]:
        """Commands grouped by the node owning their slot in the map (keyed by node name:
        a str hashes once, a ClusterNode in Python on every lookup); a slot no node
        serves fails its keys under the cluster's URL."""
        owner_of = self.cmap.topology.nodes_manager.get_node_from_slot
        groups: dict[str, tuple[Target, list[Command]]] = {}
        for command in commands:
            try:
                owner = owner_of(command.slot)
            except (rexc.SlotNotCoveredError, KeyError):  # redis-py 8 lets a KeyError out
                url = self.cmap.safe_url
                self.fail(NodeName(url), StoreUnavailable(
                    f"slot {command.slot} of redis cluster {url} is served by no node"),
                    [command])
                continue
            group = groups.get(owner.name)
            if group is None:
                group = (Target(NodeName(owner.name), owner.host, int(owner.port)), [])
                groups[owner.name] = group
            group[1].append(command)
        return groups

    async def _follow(self, redirects: list[tuple[Command, Target]]) -> None:
        """Send redirected commands once more, to the named nodes; after a ``MOVED``,
        re-read the slot map at the same time (the retry does not need it)."""
        again: dict[Target, list[Command]] = {}
        for command, target in redirects:
            again.setdefault(target, []).append(command)
        moved = any(not target.asking for target in again)
        await asyncio.gather(
            *([self.cmap.refresh()] if moved else []),
            *(self._exchange(target, cmds, None) for target, cmds in again.items()))

    async def _exchange(self, target: Target, commands: list[Command],
                        redirects: list[tuple[Command, Target]] | None) -> None:
        """One node's commands, pipelined; ``redirects`` collects MOVED/ASK replies (None
        on a retry: a second redirection fails those keys)."""
        node, asking = target.node, target.asking
        if node in self.skip:
            self.skipped += sum(len(c.positions) for c in commands)
            return
        conn = self.cmap.connection(target)
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

    def handle(self, target: Target, command: Command, reply: Any,
               redirects: list[tuple[Command, Target]] | None) -> None:
        """One reply: a redirection is collected (or, on a retry, fails), an error about
        the node fails its keys, anything else goes to `on_reply()`."""
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


class Read(_Call):
    """A read: per node, one pipelined exchange of a ``GET`` per key (an ``MGET`` per slot
    for a slot holding several keys of the batch), parsed in one pass; only the rare
    error replies become `Command`s, for the redirection and failure logic."""

    def __init__(self, cmap: ClusterMap,
                 skip: Collection[NodeName], n: int) -> None:
        super().__init__(cmap, skip)
        self.values: list[Any] = [NOT_READ] * n

    async def read(self, keys: Sequence[bytes]) -> None:
        slots = key_slots(keys)
        owners = self.cmap.view.owners
        groups: dict[NodeName | None, list[int]] = {}
        distinct = len(set(slots)) == len(slots)  # no slot with two keys (most batches)
        for position, node in enumerate([owners[slot] for slot in slots]):
            group = groups.get(node)
            if group is None:
                groups[node] = [position]
            else:
                group.append(position)
        unserved = groups.pop(None, None)
        if unserved is not None:
            url = self.cmap.safe_url
            self.fail(NodeName(url), StoreUnavailable(
                f"slot {slots[unserved[0]]} of redis cluster {url} is served by no node"),
                len(unserved))
        # every node's request is written first, then the replies are awaited in turn:
        # the nodes work concurrently without a Task per node
        redirects: list[tuple[Command, Target]] = []
        primaries = self.cmap.view.primaries
        sent: list[tuple[Target, list[int], list[Command] | None, RespConnection, Any]] = []
        for node, positions in groups.items():
            assert node is not None  # the unserved ones were popped above
            if node in self.skip:
                self.skipped += len(positions)
                continue
            host, port = primaries[node]
            target = Target(node, host, port)
            try:
                commands, data, n = self._pack(keys, slots, positions, distinct)
                conn = self.cmap.connection(target)
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
            self.cmap.refresh_soon()

    def _pack(self, keys: Sequence[bytes], slots: list[int], positions: list[int],
              distinct: bool) -> tuple[list[Command] | None, bytes, int]:
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
                commands.append(Command(slot, at, [pack_gets((keys[at[0]],))]))
            else:
                commands += [Command(slot, chunk, [pack_mget([keys[p] for p in chunk])])
                             for chunk in chunked(at, self.cmap.max_batch)]
        return commands, b"".join([c.request[0] for c in commands]), len(commands)

    def _scatter(self, target: Target, keys: Sequence[bytes], slots: list[int],
                 positions: list[int], commands: list[Command] | None, replies: list[Any],
                 redirects: list[tuple[Command, Target]]) -> None:
        """A node's replies into the values; error replies to `handle()`."""
        values = self.values
        if commands is None:
            if _ReplyError not in map(type, replies):
                for position, value in zip(positions, replies):
                    values[position] = value
                return
            commands = [Command(slots[p], [p], []) for p in positions]
        for command, reply in zip(commands, replies):
            if len(command.positions) == 1 and type(reply) is not list:  # a GET's reply
                if type(reply) is not _ReplyError:
                    values[command.positions[0]] = reply
                    continue
                # a retry (after MOVED / ASK) goes as an MGET of one key
                command.request = [pack_mget((keys[command.positions[0]],))]
            self.handle(target, command, reply, redirects)

    def on_reply(self, node: NodeName, command: Command, reply: Any) -> None:
        try:
            got = check_mget_reply(reply, f"cluster node {node}", len(command.positions))
        except StoreError as exc:  # an error reply, or a garbled one: these keys miss
            self.fail(node, exc, [command])
            return
        values = self.values
        for position, value in zip(command.positions, got):
            values[position] = value


class Write(_Call):
    def __init__(self, cmap: ClusterMap,
                 skip: Collection[NodeName], items: Sequence[tuple[bytes, bytes]]) -> None:
        super().__init__(cmap, skip)
        self.items = items
        self.written = 0
        self.rejected: dict[bytes, StoreError] = {}

    def on_reply(self, node: NodeName, command: Command, reply: Any) -> None:
        if not is_error(reply):
            self.written += 1
            return
        key, value = self.items[command.positions[0]]
        size = memoryview(value).nbytes
        self.rejected[key] = StoreRejected(
            explain_rejection(reply, f"cluster node {node}", size))


class Delete(_Call):
    def on_reply(self, node: NodeName, command: Command, reply: Any) -> None:
        if is_error(reply):
            self.fail(node, StoreError(f"redis cluster node {node} refused DEL: {reply}"),
                      [command])


class PerKey(_Call, Generic[T]):
    """One command per key, each answering one thing about its key: ``parse(reply,
    where)`` of each reply lands at the key's position of `results` (a `StoreError`
    from ``parse`` fails the node's keys, as a refused command does)."""

    def __init__(self, cmap: ClusterMap, n: int, unanswered: T,
                 parse: Callable[[Any, str], T]) -> None:
        super().__init__(cmap, ())
        self.results: list[T] = [unanswered] * n
        self.parse = parse

    def on_reply(self, node: NodeName, command: Command, reply: Any) -> None:
        try:
            self.results[command.positions[0]] = self.parse(reply, f"cluster node {node}")
        except StoreError as exc:
            self.fail(node, exc, [command])


def added(reply: Any, where: str) -> bool:
    """``SET NX PX``: whether the key was absent (and is now set)."""
    if is_error(reply):
        raise StoreError(f"redis {where} refused SET NX: {reply}")
    return reply is not None


def exists(reply: Any, where: str) -> bool:
    """``EXISTS``: whether the key is there."""
    if is_error(reply):
        raise StoreError(f"redis {where} refused EXISTS: {reply}")
    return bool(reply == 1)
