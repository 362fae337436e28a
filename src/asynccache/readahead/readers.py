"""Where a prefetcher's reads go: one small interface, two implementations.

Why it is built this way: docs/design.md, "Readers".
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from .._interrupts import raised_in_signal_handler
from ..cache.port import CachePort, ChunkManifest, chunk_keys_of
from ..errors import CacheError, LoopError, StoreError
from ..store.api import NOT_READ, ConsumerReads
from ..store.loop import LoopThread

__all__ = ["L1Reader", "LoopReader", "Reader", "SocketReader", "Ticket"]

logger = logging.getLogger("asynccache")

#: a consumer that did not call into its reader for this long was away (see resume)
AWAY = 0.05


class Ticket:
    """One read of a batch of keys, from submission to its values."""

    __slots__ = ("abandoned", "arrived", "chunks_of", "deadline", "direct", "done", "epoch",
                 "error", "generation", "indices", "keys", "largest", "nbytes", "parent",
                 "partial", "remaining", "values", "waiting_for")

    def __init__(self, indices: list[Any], keys: list[bytes], *, direct: bool = False,
                 generation: int = 0) -> None:
        self.indices = indices
        self.keys = keys
        self.direct = direct          # the consumer waits for it now (not read-ahead)
        self.generation = generation  # the prefetcher's plan generation it belongs to
        self.epoch = 0                # the prefetcher's epoch clock when it was sent
        self.values: list[Any] = []
        self.error: CacheError | None = None
        self.partial = False          # some values are NOT_READ
        self.done = False
        self.abandoned = False        # the consumer stopped waiting: ignore its result
        self.deadline = 0.0
        self.remaining = 0            # parts still on the wire (SocketReader)
        self.nbytes = 0               # bytes the store's replies carried (set when done)
        self.largest = 0              # the largest value's bytes among them
        #: (the ticket this one reads the rest of, positions there): L1Reader
        self.parent: tuple[Ticket, list[int]] | None = None
        #: held until the loop thread completed it (LoopReader; see LoopReader.wait)
        self.arrived: Any = None
        #: SocketReader: a ticket reading the chunks of another's chunked values (that
        #: ticket and its manifests), and the one a ticket waits for to be complete
        self.chunks_of: tuple[Ticket, dict[int, ChunkManifest]] | None = None
        self.waiting_for: Ticket | None = None


class Reader(ABC):
    """The prefetcher's I/O, behind one interface (tests use a scripted fake)."""

    #: nodes a batch is spread over (see ConsumerReads.fanout)
    fanout = 1

    @abstractmethod
    def submit(self, ticket: Ticket) -> None:
        """Start reading ``ticket.keys``; returns without waiting for the store."""

    @abstractmethod
    def poll(self) -> list[Ticket]:
        """Tickets completed since the last call, without blocking."""

    @abstractmethod
    def wait(self, ticket: Ticket) -> bool:
        """Block until ``ticket`` completes; False if it could not within its deadline."""

    def advance(self, ticket: Ticket) -> list[Ticket]:
        """Like `poll()`, but doing no more work than ``ticket`` needs: the consumer
        waits for it, and what else arrived is left for the reads that need it, so no
        single read pays for receiving and decoding a whole window of read-ahead."""
        return self.poll()

    def close(self) -> None:
        """Drop what is in flight and release connections (the consumer thread's)."""
        return None

    def reset(self) -> None:
        """Forget every ticket in flight and start afresh: the consumer was stopped by an
        exception (an interrupt) between two steps, so what is on the wire and what the
        consumer recorded may disagree. Tickets sent before are never completed by this
        reader after it (their owner abandons them); connections reopen on the next
        request."""
        self.close()

    async def cancel_pending(self) -> None:
        """Cancel loop-side work still running (called on the loop thread)."""
        return None


class SocketReader(Reader):
    """Read-ahead on the consumer's own connections, one per node."""

    def __init__(self, port: CachePort, reads: ConsumerReads, loop: LoopThread) -> None:
        self.port = port
        self.policy = port.policy
        self.loop = loop
        self.conns = reads.connections
        #: every connection's large values are memory of their own: decoded in place
        self.owned = all(conn.owns_buffers for conn in self.conns)
        self.fanout = reads.fanout
        self.route = reads.route
        self.histograms = port.histograms
        #: per connection, the ticket parts on its wire, oldest first:
        #: (ticket, positions, perf_counter_ns when sent)
        self.parts: list[collections.deque[tuple[Ticket, list[int] | None, int]]] = [
            collections.deque() for _ in self.conns]
        self.completed: list[Ticket] = []
        self.timeout = port.client.timeout
        self.looked = 0.0  # time.monotonic() at the end of the last call into this reader

    def resume(self) -> None:
        """Deadlines run while the consumer is here. Back from longer than ``AWAY``
        elsewhere (a training step longer than ``timeout``), its read-ahead's replies
        may sit in the sockets, or behind them in the servers that the full sockets hold
        back: not a slow server, so every pending request gets ``timeout`` from now. A
        consumer that is waiting, here, on one node keeps every node's clock running: a
        trickling pool costs one ``timeout``, not one per node."""
        now = time.monotonic()
        if now - self.looked > AWAY:
            at_least = now + self.timeout
            for conn in self.conns:
                conn.extend_deadlines(at_least)

    def submit(self, ticket: Ticket) -> None:
        self.resume()
        keys = ticket.keys
        ticket.values = [NOT_READ] * len(keys)
        down = self.policy.down()
        routes: Sequence[tuple[int, list[int] | None]]
        routes = [(0, None)] if len(self.conns) == 1 else self.route(keys)
        skipped = 0
        for ci, positions in routes:
            conn = self.conns[ci]
            if conn.node in down:
                skipped += len(keys) if positions is None else len(positions)
                ticket.partial = True
                continue
            sent = time.perf_counter_ns()
            try:
                conn.send_get(keys if positions is None else [keys[p] for p in positions])
            except StoreError as exc:
                ticket.partial = True
                ticket.error = ticket.error or exc
                self._lost(ci, exc)
                continue
            self.parts[ci].append((ticket, positions, sent))
            ticket.remaining += 1
        counters = self.port.counters.shard()
        counters["keys_requested"] += len(keys)
        if skipped:
            self.policy.skipped(skipped)
        if not ticket.remaining:
            self._finish(ticket)
        self.looked = time.monotonic()

    def poll(self) -> list[Ticket]:
        self.resume()
        try:
            return self._poll()
        finally:
            self.looked = time.monotonic()

    def _poll(self) -> list[Ticket]:
        for ci in range(len(self.conns)):
            if self.parts[ci]:
                self._read(ci, None)
        completed, self.completed = self.completed, []
        return completed

    def _read(self, ci: int, limit: int | None) -> None:
        """The replies connection ``ci`` has (at most ``limit``), matched to their parts."""
        conn = self.conns[ci]
        try:
            replies = conn.poll(limit)
        except StoreError as exc:
            self._lost(ci, exc)
            return
        for reply in replies:
            if not self._arrived(ci, reply):
                return  # the rest came on a stream that is not trusted any more

    def advance(self, ticket: Ticket) -> list[Ticket]:
        self.resume()
        try:
            return self._advance(ticket)
        finally:
            self.looked = time.monotonic()

    def _advance(self, ticket: Ticket) -> list[Ticket]:
        for ci, parts in enumerate(self.parts):
            if ticket.done:
                break
            # replies come in order: parse this connection only up to the ticket's part
            upto = next((n for n, (t, _, _) in enumerate(parts) if t is ticket), None)
            if upto is not None:
                self._read(ci, upto + 1)
        if not ticket.done and ticket.waiting_for is not None:  # its chunks, sent just now
            self._advance(ticket.waiting_for)
        completed, self.completed = self.completed, []
        return completed

    def wait(self, ticket: Ticket) -> bool:
        self.resume()
        try:
            return self._wait_for(ticket)
        finally:
            self.looked = time.monotonic()

    def _wait_for(self, ticket: Ticket) -> bool:
        while not ticket.done:
            wanted = ticket.waiting_for or ticket  # its own parts, else its chunks'
            ci = next((ci for ci, parts in enumerate(self.parts)
                       if any(t is wanted for t, _, _ in parts)), None)
            if ci is None:  # on no wire (a reset dropped it): no reply can complete it
                wanted.partial = True
                wanted.error = wanted.error or StoreError(
                    "a read was dropped with its connection; it is read again")
                wanted.remaining = 0
                self._finish(wanted)
                continue
            try:
                reply = self.conns[ci].receive()
            except StoreError as exc:
                self._lost(ci, exc)
                continue
            self._arrived(ci, reply)
        return True

    def _arrived(self, ci: int, reply: list[Any]) -> bool:
        """Match a reply to the oldest part on its wire; False (and the connection
        dropped) when it cannot be that part's."""
        parts = self.parts[ci]
        if not parts:  # a reply nobody on this wire asked for: the stream is not ours
            self._lost(ci, StoreError(f"{self.conns[ci].node} answered a request that was "
                                      "never sent; its connection is dropped"))
            return False
        ticket, positions, sent = parts[0]
        if len(reply) != (len(ticket.keys) if positions is None else len(positions)):
            self._lost(ci, StoreError(
                f"{self.conns[ci].node} answered {len(reply)} values to a request for "
                f"{len(ticket.keys) if positions is None else len(positions)} keys; its "
                "connection is dropped (no reply is matched to another request)"))
            return False
        parts.popleft()
        self.histograms.record("read", time.perf_counter_ns() - sent)
        if positions is None:
            ticket.values = reply
        else:
            values = ticket.values
            for position, value in zip(positions, reply):
                values[position] = value
        self.policy.succeeded(self.conns[ci].node)
        ticket.remaining -= 1
        if not ticket.remaining:
            self._finish(ticket)
        return True

    def _lost(self, ci: int, exc: StoreError) -> None:
        """Connection ``ci`` failed: it is dropped together with every request queued on
        it (closed, so that no reply still buffered in it can ever be matched to a request
        sent later: the next request opens a fresh one), and every part on its wire is
        lost."""
        conn = self.conns[ci]
        self.policy.failed(conn.node, "get", exc)
        try:
            conn.close()
        except Exception as failed:  # a provider's close() must not stop the reads
            if raised_in_signal_handler(failed):
                raise
            logger.debug("asynccache: closing the connection to %s failed: %r", conn.node,
                         failed)
        parts = self.parts[ci]
        now = time.perf_counter_ns()
        while parts:
            ticket, _positions, sent = parts.popleft()
            self.histograms.record("read", now - sent)  # it ended: failed after this long
            ticket.partial = True
            ticket.error = ticket.error or exc
            ticket.remaining -= 1
            if not ticket.remaining:
                self._finish(ticket)

    def _finish(self, ticket: Ticket) -> None:
        port = self.port
        port.counters.shard()["batches"] += 1
        if ticket.chunks_of is not None:
            self._chunks_read(ticket)
            return
        values, manifests, ticket.nbytes, ticket.largest = port.decode(
            ticket.keys, ticket.values, owned=self.owned)
        ticket.values = values
        if manifests:
            # chunked values: their chunks on these same connections (received in place
            # like any large value), in one more request; the ticket completes with it
            chunk_read = Ticket([], chunk_keys_of(ticket.keys, manifests),
                                direct=ticket.direct, generation=ticket.generation)
            chunk_read.chunks_of = (ticket, manifests)
            ticket.waiting_for = chunk_read
            self.submit(chunk_read)
            return
        ticket.done = True
        self.completed.append(ticket)

    def _chunks_read(self, chunk_read: Ticket) -> None:
        """The chunks of a ticket's chunked values arrived (or failed: those values stay
        misses, the failure counted where it happened): join them, complete the ticket."""
        assert chunk_read.chunks_of is not None
        ticket, manifests = chunk_read.chunks_of
        # the window's budget counts what was read, the largest value whole
        ticket.nbytes += sum(len(blob) for blob in chunk_read.values
                             if blob is not None and blob is not NOT_READ)
        ticket.largest = max(ticket.largest, *(m.size for m in manifests.values()))
        self.port.assemble(ticket.keys, manifests, ticket.values, chunk_read.values)
        ticket.waiting_for = None
        ticket.done = True
        self.completed.append(ticket)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for parts in self.parts:
            parts.clear()
        self.completed.clear()


class LoopReader(Reader):
    """Read-ahead through the asyncio core on the loop thread, handed back per batch.

    The loop thread never waits for the consumer: it completes a ticket by releasing the
    ticket's own lock, which the consumer acquires to wait (`wait()`). A lock shared both
    ways (a Condition) is not safe here: an exception raised in the consumer while it
    re-acquires the lock (a signal handler's, at any bytecode) leaves it released under
    the loop thread's feet, and a later acquire blocks for ever.
    """

    def __init__(self, port: CachePort, loop: LoopThread, wait_timeout: float) -> None:
        self.port = port
        self.loop = loop
        self.wait_timeout = wait_timeout
        self.completed: collections.deque[Ticket] = collections.deque()
        self.tasks: set[asyncio.Task[None]] = set()  # loop thread only: strong refs

    def submit(self, ticket: Ticket) -> None:
        ticket.deadline = time.monotonic() + self.wait_timeout
        arrived = threading.Lock()
        arrived.acquire()
        ticket.arrived = arrived
        self.loop.call_soon(self._start, ticket)

    def _start(self, ticket: Ticket) -> None:  # loop thread
        task = self.loop.loop.create_task(self._read(ticket))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _read(self, ticket: Ticket) -> None:  # loop thread
        values: list[Any] | None = None
        try:
            sizes: list[tuple[int, int]] = []
            values, ticket.error = await self.port.read(ticket.keys, sizes)
            ticket.nbytes = sum(nbytes for nbytes, _ in sizes)
            ticket.largest = max((largest for _, largest in sizes), default=0)
        except CacheError as exc:  # e.g. a key the policy refused; never lose the ticket
            ticket.error = exc
        except Exception as exc:  # an asynccache bug must not hang the consumer
            ticket.error = StoreError(f"read-ahead failed: {type(exc).__name__}: {exc}")
        finally:  # cancelled too: every waiter must be woken
            if values is None:
                values = [NOT_READ] * len(ticket.keys)
            ticket.partial = any(v is NOT_READ for v in values)
            ticket.values = values
            ticket.done = True
            self.completed.append(ticket)
            ticket.arrived.release()  # after done: a waiter that acquires it sees done

    def poll(self) -> list[Ticket]:
        completed = self.completed
        out = []
        while completed:
            out.append(completed.popleft())
        return out

    def wait(self, ticket: Ticket) -> bool:
        if ticket.done:
            return True
        if self.loop.in_loop_thread():
            raise LoopError("a pipe read was called from asynccache's own loop thread, which "
                            "would deadlock; inside async code use AsyncKVCache directly")
        while not ticket.done:
            remaining = ticket.deadline - time.monotonic()
            if remaining <= 0:
                return False
            ticket.arrived.acquire(timeout=remaining)
        return True

    def close(self) -> None:
        self.completed.clear()  # late completions land here and are ignored (abandoned)

    async def cancel_pending(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class L1Reader(Reader):
    """The L1 tier in front of another reader: keys the process holds are served from
    memory (decoded afresh); only the others go to ``inner``, as a ticket of their own
    that is merged back into the one the prefetcher knows."""

    def __init__(self, inner: Reader, port: CachePort) -> None:
        self.inner = inner
        self.fanout = inner.fanout
        self.port = port
        self.completed: list[Ticket] = []
        self.rest: dict[int, Ticket] = {}  # id(ticket) -> the ticket reading its misses

    def submit(self, ticket: Ticket) -> None:
        values, missing = self.port.from_l1(ticket.keys)
        if not missing:
            ticket.values = values
            ticket.done = True
            self.completed.append(ticket)
            return
        if len(missing) == len(ticket.keys):
            self.inner.submit(ticket)
            return
        ticket.values = values
        rest = Ticket([ticket.indices[i] for i in missing], [ticket.keys[i] for i in missing],
                      direct=ticket.direct, generation=ticket.generation)
        rest.parent = (ticket, missing)
        self.rest[id(ticket)] = rest
        self.inner.submit(rest)

    def _merged(self, ticket: Ticket) -> Ticket | None:
        """The ticket to hand back for one ``inner`` completed: itself, or its parent
        (once: None if the parent was already merged by a wait)."""
        if ticket.parent is None:
            return ticket
        parent, positions = ticket.parent
        if self.rest.pop(id(parent), None) is None:
            return None
        for position, value in zip(positions, ticket.values):
            parent.values[position] = value
        parent.error = ticket.error
        parent.partial = ticket.partial
        parent.nbytes = ticket.nbytes  # what crossed the wire (L1 hits did not)
        parent.largest = ticket.largest
        parent.done = True
        return parent

    def poll(self) -> list[Ticket]:
        out, self.completed = self.completed, []
        for ticket in self.inner.poll():
            merged = self._merged(ticket)
            if merged is not None:
                out.append(merged)
        return out

    def advance(self, ticket: Ticket) -> list[Ticket]:
        rest = self.rest.get(id(ticket))
        out, self.completed = self.completed, []
        for done in self.inner.advance(ticket if rest is None else rest):
            merged = self._merged(done)
            if merged is not None:
                out.append(merged)
        return out

    def wait(self, ticket: Ticket) -> bool:
        if ticket.done:
            return True
        rest = self.rest.get(id(ticket))
        if rest is None:
            return self.inner.wait(ticket)
        if not self.inner.wait(rest):
            return False
        merged = self._merged(rest)
        if merged is not None:
            self.completed.append(merged)
        return True

    def close(self) -> None:
        self.inner.close()
        self.rest.clear()
        self.completed.clear()

    def reset(self) -> None:
        self.inner.reset()
        self.rest.clear()
        self.completed.clear()

    async def cancel_pending(self) -> None:
        await self.inner.cancel_pending()
