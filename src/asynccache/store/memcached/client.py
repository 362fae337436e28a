"""memcached, one server or a pool of them, on a lean pipelined text-protocol connection.

Why it is built this way: docs/design.md, "memcached".
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ...errors import StoreError, StoreRejected
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
from ..protocol.memcache import (
    STORED,
    VERSION,
    ErrorReply,
    Reply,
    Request,
    explain_rejection,
    hashed_prefix,
    meta_size,
    pack_add,
    pack_delete,
    pack_exists,
    pack_get,
    pack_set,
    pack_size,
    safe_memcached_key,
    safe_memcached_keys,
)
from ..transport.endpoint import Endpoint
from ..transport.tls import TlsSettings
from .admin import metadump_keys, settings
from .connection import MemcachedConnection, memcached_endpoint
from .consumer import BlockingMemcachedConnection

__all__ = ["MemcachedClient", "MemcachedConnection", "rendezvous_owner", "safe_memcached_key"]

T = TypeVar("T")

_THIRTY_DAYS = 30 * 24 * 3600
#: The last absolute exptime memcached reads right (a signed 32-bit Unix time: 2038-01-19).
_LAST_UNIX_TIME = 2**31 - 1
#: Room for memcached's per-item header within the slab item size.
_ITEM_OVERHEAD = 1024


def rendezvous_owner(key: bytes, nodes: Sequence[str]) -> int:
    """Index of the node with the highest hash weight for ``key``."""
    best, best_weight = 0, -1
    for index, node in enumerate(nodes):
        digest = hashlib.blake2b(key, digest_size=8, key=node.encode()[:64]).digest()
        weight = int.from_bytes(digest, "big")
        if weight > best_weight:
            best, best_weight = index, weight
    return best


@dataclass
class _Node:
    name: NodeName
    reads: MemcachedConnection
    writes: MemcachedConnection  # a large write never delays a read

    def close(self) -> None:
        self.reads.close()
        self.writes.close()


@dataclass
class _MemcachedState:
    nodes: list[_Node]


class MemcachedClient(BaseClient[_MemcachedState]):
    """Client for one or more memcached servers (rendezvous hashing across them)."""

    scheme = "memcached"
    expiry_slack = 1.0  # exptime is whole seconds on a one-second clock
    reads_own_buffers = True  # large values are received in place (connection.py)

    def __init__(
        self,
        *,
        servers: Sequence[tuple[str, int]] = (("127.0.0.1", 11211),),
        item_size: int = 1024 * 1024,
        tls: TlsSettings | None = None,
        **options: Any,
    ) -> None:
        """The servers, and how to reach them.

        Args:
            servers: ``(host, port)`` of each server; keys are spread over them by
                rendezvous hashing.
            item_size: the servers' ``-I`` (largest item), in bytes: larger values are
                chunked.
            tls: TLS to every server (memcached's ``-Z``), the same settings for all.
            **options: `BaseClient`'s: ``timeout``, ``connect_timeout``, ``max_batch``
                (default 128).
        """
        options.setdefault("max_batch", 128)
        super().__init__(**options)
        if not servers:
            raise ValueError("MemcachedClient needs at least one server")
        self.servers = [(str(h), int(p)) for h, p in servers]
        self.tls = tls
        self.item_size = int(item_size)
        self.max_value_size = self.item_size - _ITEM_OVERHEAD
        self._node_names = tuple(NodeName(f"{h}:{p}") for h, p in self.servers)

    @property
    def safe_url(self) -> str:
        return "memcached://" + ",".join(self._node_names) + ("?tls=true" if self.tls else "")

    @property
    def node_names(self) -> tuple[NodeName, ...]:
        return self._node_names

    def _open_state(self) -> _MemcachedState:
        return _MemcachedState([
            _Node(name, self._connection(host, port), self._connection(host, port))
            for name, (host, port) in zip(self._node_names, self.servers)])

    def _endpoint(self, host: str, port: int) -> Endpoint:
        return memcached_endpoint(host, port, tls=self.tls, timeout=self.timeout,
                                  connect_timeout=self.connect_timeout)

    def _connection(self, host: str, port: int) -> MemcachedConnection:
        return MemcachedConnection(self._endpoint(host, port), max_value=2 * self.item_size)

    async def _close_state(self, state: _MemcachedState) -> None:
        for node in state.nodes:
            node.close()

    def _owner(self, safe_key: bytes) -> int:
        if len(self._node_names) == 1:
            return 0
        return rendezvous_owner(safe_key, self._node_names)

    def consumer_reads(self) -> ConsumerReads:
        """One blocking connection per server for read-ahead on the consumer's thread."""
        connections: list[ConsumerConnection] = [
            BlockingMemcachedConnection(self._endpoint(host, port), max_value=2 * self.item_size,
                                        max_batch=self.max_batch)
            for host, port in self.servers]
        return ConsumerReads(connections, self._route, fanout=len(connections))

    def _route(self, keys: Sequence[bytes]) -> list[tuple[int, list[int]]]:
        """Positions of ``keys`` per owning server (the connections map keys themselves)."""
        groups: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            groups.setdefault(self._owner(safe_memcached_key(key)), []).append(position)
        return list(groups.items())

    # -- what the core calls: per-node results ---------------------------------------
    async def read(self, keys: Sequence[bytes], skip: Collection[NodeName] = ()) -> ReadResult:
        values: list[Any] = [NOT_READ] * len(keys)
        result = ReadResult(values)
        if not keys:
            return result
        nodes = self._state().nodes
        asked: list[_Node] = []
        calls = []
        for index, (positions, safe) in self._per_node(keys).items():
            node = nodes[index]
            if node.name in skip:
                result.skipped += len(positions)
                continue
            asked.append(node)
            calls.append(self._read_node(node, positions, safe, values))
        for node, error in zip(asked, await _concurrently(calls)):
            if error is None:
                result.answered.append(node.name)
            else:
                result.failures[node.name] = error
        return result

    def _per_node(self, keys: Sequence[bytes]
                  ) -> Mapping[int, tuple[Sequence[int], list[bytes]]]:
        """Per owning server: the positions of its keys, and those keys for memcached."""
        safe = safe_memcached_keys(keys)
        if len(self._node_names) == 1:
            return {0: (range(len(safe)), safe)}
        groups: dict[int, tuple[list[int], list[bytes]]] = {}
        for position, key in enumerate(safe):
            group = groups.get(owner := self._owner(key))
            if group is None:
                group = groups[owner] = ([], [])
            group[0].append(position)
            group[1].append(key)
        return groups

    async def _read_node(self, node: _Node, positions: Sequence[int], safe: list[bytes],
                         values: list[Any]) -> StoreError | None:
        """Fill ``values`` at ``positions`` with ``node``'s answers for the keys ``safe``
        (each distinct key asked once); its failure is returned, not raised."""
        unique = list(dict.fromkeys(safe))
        requests = [pack_get(chunk) for chunk in chunked(unique, self.max_batch)]
        try:
            replies = await node.reads.execute(requests)
        except StoreError as exc:
            return exc
        values_per_request: list[list[bytes | None]] = []
        for reply in replies:
            if isinstance(reply, ErrorReply):
                return StoreError(f"memcached {node.name} answered get with {reply}")
            values_per_request.append(_values(reply))
        found: Iterator[Any] = itertools.chain.from_iterable(values_per_request)
        if len(unique) != len(safe):  # repeated keys: every position gets its key's value
            by_key = dict(zip(unique, found))
            found = (by_key[key] for key in safe)
        elif type(positions) is range and positions.step == 1:  # one node: all of them
            values[positions.start:positions.stop] = values_per_request[0] \
                if len(values_per_request) == 1 else found
            return None
        for position, value in zip(positions, found):
            values[position] = value
        return None

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        result = WriteResult()
        if not entries:
            return result
        nodes = self._state().nodes
        exptime = _exptime(ttl)
        groups: dict[int, list[tuple[bytes, bytes, Request]]] = {}
        for key, value in entries.items():
            safe = safe_memcached_key(key)
            groups.setdefault(self._owner(safe), []).append(
                (key, value, pack_set(safe, value, exptime)))
        asked: list[tuple[_Node, list[tuple[bytes, bytes, Request]]]] = []
        calls = []
        for index, items in groups.items():
            node = nodes[index]
            if node.name in skip:
                result.skipped += len(items)
                continue
            asked.append((node, items))
            calls.append(_attempt(node.writes.execute([request for _, _, request in items])))
        for (node, items), outcome in zip(asked, await _concurrently(calls)):
            if isinstance(outcome, StoreError):
                result.failures[node.name] = outcome
                result.failed_keys += len(items)
                continue
            result.answered.append(node.name)
            for (key, value, _), reply in zip(items, outcome):
                if reply == STORED:
                    result.written += 1
                else:
                    size = memoryview(value).nbytes
                    result.rejected[key] = StoreRejected(explain_rejection(reply, node.name, size))
        return result

    # -- all or nothing -------------------------------------------------------------------
    async def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        nodes = self._state().nodes
        groups: dict[int, list[Request]] = {}
        for safe in dict.fromkeys(safe_memcached_key(k) for k in keys):
            groups.setdefault(self._owner(safe), []).append(pack_delete(safe))
        await _on_every_node([(nodes[i], requests) for i, requests in groups.items()],
                             "delete")

    async def ping(self) -> None:
        await _on_every_node([(node, [VERSION]) for node in self._state().nodes], "version")

    # -- administration -------------------------------------------------------------------
    def _admin(self, index: int) -> Endpoint:
        return self._endpoint(*self.servers[index])

    async def server_info(self) -> dict[str, Any]:
        """Per server: its ``version`` and ``item_size`` (``-I``, from ``stats settings``)."""
        infos = await _concurrently([self._node_info(i) for i in range(len(self.servers))])
        return {"max_value_size": self.max_value_size, "nodes": dict(zip(self._node_names, infos))}

    async def _node_info(self, index: int) -> dict[str, Any]:
        node = self._state().nodes[index]
        (reply,) = await node.reads.execute([VERSION])
        if isinstance(reply, ErrorReply):
            raise StoreError(f"memcached {node.name} answered version with {reply}")
        found = await settings(self._admin(index))
        item_size = found.get("item_size_max", "")
        return {"server": "memcached", "version": _line(reply).partition(b" ")[2].decode(),
                "item_size": int(item_size) if item_size.isdigit() else None}

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        """Keys under ``prefix`` on every server (``lru_crawler metadump all``), with their
        value sizes (``mg key s``, pipelined; a key gone meanwhile is left out).

        Keys are yielded as the server holds them: a key memcached could not take
        verbatim is in its digest form (see `safe_memcached_key()`), found through
        its namespace prefix, and maps to itself when passed back to ``delete_many``."""
        starts = (prefix, hashed_prefix(prefix))
        for index in range(len(self.servers)):
            found: list[bytes] = []
            async for key in metadump_keys(self._admin(index)):
                if key.startswith(starts):
                    found.append(key)
                    if len(found) >= batch:
                        yield await self._sizes(index, found)
                        found = []
            if found:
                yield await self._sizes(index, found)

    async def _sizes(self, index: int, keys: list[bytes]) -> list[tuple[bytes, int | None]]:
        node = self._state().nodes[index]
        replies = await node.reads.execute([pack_size(key) for key in keys])
        listed = []
        for key, reply in zip(keys, replies):
            if isinstance(reply, ErrorReply):
                raise StoreError(f"memcached {node.name} answered mg with {reply}")
            if not _line(reply).startswith(b"EN"):
                listed.append((key, meta_size(_line(reply))))
        return listed

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``mg key`` per key (no value transferred), servers concurrently."""
        lines = await self._meta_lines(keys, pack_exists)
        return [line is not None for line in lines]

    async def sizes_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """``mg key s`` per key (the size; no value transferred), servers concurrently."""
        lines = await self._meta_lines(keys, pack_size)
        return [None if line is None else meta_size(line) or None for line in lines]

    async def _meta_lines(self, keys: Sequence[bytes],
                          pack: Callable[[bytes], Request]) -> list[bytes | None]:
        """One meta request per key (``pack(key)``), each server's keys in one pipeline,
        servers concurrently: each key's reply line, None where the key is absent."""
        lines: list[bytes | None] = [None] * len(keys)
        if not keys:
            return lines
        nodes = self._state().nodes
        work = [(nodes[i], positions, [pack(k) for k in safe])
                for i, (positions, safe) in self._per_node(keys).items()]
        outcomes = await _concurrently([_attempt(node.reads.execute(requests))
                                        for node, _, requests in work])
        for (node, positions, _), outcome in zip(work, outcomes):
            if isinstance(outcome, StoreError):
                raise outcome
            for position, reply in zip(positions, outcome):
                if isinstance(reply, ErrorReply):
                    raise StoreError(f"memcached {node.name} answered mg with {reply}")
                line = _line(reply)
                if not line.startswith(b"EN"):
                    lines[position] = line
        return lines

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        """memcached ``add`` per key, expiring by `_exptime()` (a lease that ended
        early would let another process compute what this one is computing)."""
        nodes = self._state().nodes
        exptime = _exptime(ttl)
        keys = list(entries)
        groups: dict[int, list[int]] = {}
        safe = [safe_memcached_key(k) for k in keys]
        for position, key in enumerate(safe):
            groups.setdefault(self._owner(key), []).append(position)
        work = [(nodes[i], [pack_add(safe[p], entries[keys[p]], exptime) for p in positions])
                for i, positions in groups.items()]
        outcomes = await _concurrently([_attempt(node.writes.execute(requests))
                                        for node, requests in work])
        added = [False] * len(keys)
        for (node, _), positions, outcome in zip(work, groups.values(), outcomes):
            if isinstance(outcome, StoreError):
                raise outcome
            for position, reply in zip(positions, outcome):
                if isinstance(reply, ErrorReply):
                    raise StoreError(f"memcached {node.name} answered add with {reply}")
                added[position] = reply == STORED
        return added


async def _on_every_node(work: list[tuple[_Node, list[Request]]], what: str) -> None:
    """Run each node's requests concurrently; raise the first failure once all ended.

    A reply that is not an error is one the request accepts (``DELETED``/``NOT_FOUND``,
    ``VERSION …``): the parser checked it.
    """
    outcomes = await _concurrently(
        [_attempt(node.reads.execute(requests)) for node, requests in work])
    for (node, _), outcome in zip(work, outcomes):
        if isinstance(outcome, StoreError):
            raise outcome
        for reply in outcome:
            if isinstance(reply, ErrorReply):
                raise StoreError(f"memcached {node.name} answered {what} with {reply}")


def _values(reply: Reply) -> list[bytes | None]:
    """A ``get``'s reply once errors are ruled out: its values. The parser checked the
    reply against the request that asked for it, and a get is answered with a list."""
    return cast("list[bytes | None]", reply)


def _line(reply: Reply) -> bytes:
    """A one-line reply (``VERSION …``, ``mg``'s ``HD``/``EN``) once errors are ruled out,
    as bytes. The parser checked it against its request: it is a line, not a list."""
    return bytes(cast(bytes, reply))


async def _attempt(call: Awaitable[T]) -> T | StoreError:
    """The call's result, or its store failure as a value."""
    try:
        return await call
    except StoreError as exc:
        return exc


async def _concurrently(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Await every call, concurrently when there are several (no task for just one)."""
    if len(calls) == 1:
        return [await calls[0]]
    return list(await asyncio.gather(*calls))


def _exptime(ttl: float | None) -> int:
    """memcached's exptime for ``ttl`` seconds: whole seconds, rounded up, plus one.

    Its clock moves once a second, so an exptime of ``n`` ends anywhere in ``(n - 1,
    n]`` after the write: ``ceil(ttl) + 1`` keeps every value at least ``ttl`` (0.1 s
    lives 1-2 s, 60 s lives 61-62 s). Beyond 30 days memcached reads an absolute Unix
    time, a signed 32-bit one: a time past 2038-01-19 reads as one in the past, and the
    value was "stored" already expired (every read a miss, no error). Such a ttl means
    "as long as the store keeps it": no expiry (0)."""
    if ttl is None:
        return 0
    seconds = math.ceil(ttl) + 1
    if seconds <= _THIRTY_DAYS:
        return seconds
    until = int(time.time()) + seconds
    return until if until <= _LAST_UNIX_TIME else 0
