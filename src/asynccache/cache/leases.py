"""Leases (``lease=``): the first process to miss a key computes it; the others wait for
its value. A lease is a short-lived key next to the value's (``SET NX PX``, memcached
``add``, a whole batch in one round trip) holding who took it; its holder writes the
value, then drops it. Store trouble, or a store without leases, means "compute here":
a lease only saves work, it is never worth a wrong or missing value."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import _fork
from ..errors import StoreError
from ..store.api import NodeName
from .keys import lease_key
from .markers import is_value

if TYPE_CHECKING:
    from .parts import CacheParts
    from .reads import ReadPath

__all__ = ["LEASE_POLL", "Claim", "ComputeMine", "Leased", "Leases", "WaitFor",
           "lease_protocol"]

#: How often a process waiting on another's lease looks for the value: from the first
#: to the last delay, growing by half each time (a value usually lands within a compute).
LEASE_POLL = (0.005, 0.1)

logger = logging.getLogger("asynccache")


class Claim(NamedTuple):
    """Step: take the leases of ``keys`` (`Leases.claim()`); the driver sends back
    ``(found, mine, theirs)``."""

    keys: list[bytes]


class ComputeMine(NamedTuple):
    """Step: compute ``keys`` (this process holds their leases), write the values, then
    drop the leases -- on failure too; the driver sends back ``{key: result}``."""

    keys: list[bytes]


class WaitFor(NamedTuple):
    """Step: wait for the values of ``keys`` others hold leases on
    (`Leases.wait_for_values()`); the driver sends back ``(found, now mine)``."""

    keys: list[bytes]


Step = Claim | ComputeMine | WaitFor


class Leased(NamedTuple):
    """What a batch of misses came to under leases: values another process wrote
    (``found``, read from the store) and what this process computed (``computed``: what
    the driver's `ComputeMine` step returned)."""

    found: dict[bytes, Any]
    computed: dict[bytes, Any]


def lease_protocol(keys: Sequence[bytes]) -> Generator[Step, Any, Leased]:
    """The one lease protocol, claim -> compute -> write -> release -> wait, for a batch
    of keys that missed: the steps, without their I/O.

    Its drivers are `Leases.run()` (the cache's loop: ``get_or_compute``, the decorator)
    and the consumer thread's (`asynccache.cache.port`: a pipe, a node), which computes in
    the calling thread and bounds each step. Keys whose lease frees up while waiting (the
    holder died or gave up) are this process's to compute."""
    found, mine, theirs = yield Claim(list(keys))
    computed = dict((yield ComputeMine(mine))) if mine else {}
    if theirs:
        more, now_mine = yield WaitFor(theirs)
        found.update(more)
        if now_mine:
            computed.update((yield ComputeMine(now_mine)))
    return Leased(found, computed)


class Leases:
    """The leases of one cache (``parts.lease`` seconds each); ``reads`` looks for the
    values leases cover."""

    def __init__(self, parts: CacheParts, reads: ReadPath) -> None:
        self.parts = parts
        self.reads = reads
        self._token: tuple[int, bytes] | None = None

    @property
    def token(self) -> bytes:
        """What this process writes into the leases it holds (pid + random: who holds it)."""
        made = self._token
        if made is None or made[0] != _fork.generation:  # a forked child: a token of its own
            token = b"%d:%s" % (os.getpid(), secrets.token_hex(8).encode())
            made = self._token = (_fork.generation, token)
        return made[1]

    async def claim(self, store_keys: Sequence[bytes]
                    ) -> tuple[dict[bytes, Any], list[bytes], list[bytes]]:
        """Take the lease on each missing key (one round trip), then look once more for
        the values of the keys taken (one more): ``(found, mine, theirs)``.

        A holder writes its value before it drops its lease, so a lease found free may
        be that of a value written since this process missed the key -- computing it
        would be the work the lease exists to save (a waiter that read just before the
        holder's write took the freed lease and computed a whole batch again). ``found``:
        those values (their fresh leases dropped); ``mine``: keys this process computes;
        ``theirs``: keys another process holds. Store trouble, or a store without
        leases: every key is ``mine`` (the lease only saves work; it is never worth a
        wrong or missing value)."""
        parts = self.parts
        taken = await self._add(store_keys)
        if taken is None:
            return {}, list(store_keys), []
        got = [k for k, ok in zip(store_keys, taken) if ok]
        theirs = [k for k, ok in zip(store_keys, taken) if not ok]
        if not got:
            return {}, [], theirs
        values, _error = await self.reads.values(got, reread=True)  # trouble: what was read
        found = {k: v for k, v in zip(got, values) if is_value(v)}
        counters = parts.counters.shard()
        if not found:
            counters["leases"] += len(got)
            return {}, got, theirs
        await self.release(list(found))
        mine = [k for k in got if k not in found]
        counters["leases"] += len(mine)
        counters["lease_hits"] += len(found)
        return found, mine, theirs

    async def _add(self, store_keys: Sequence[bytes]) -> list[bool] | None:
        """``add_many`` of our token on each key's lease: True where it was free. None
        when leases cannot be taken now (store trouble, a node backing off, or a store
        without them): a miss then costs what it costs without ``lease=``, never a round
        trip to a node known to be down."""
        parts = self.parts
        if parts.lease is None or not store_keys or parts.policy.down():
            return None
        token = self.token
        try:
            taken = await parts.client.add_many({lease_key(k): token for k in store_keys},
                                                parts.lease)
        except NotImplementedError as exc:
            if parts.policy.log.first("lease", exc):
                logger.warning("asynccache: %s cannot take leases (%s): lease= is ignored, "
                               "every process computes its own misses", parts.client.safe_url,
                               exc)
            return None
        except StoreError as exc:
            parts.policy.failed(NodeName(parts.client.safe_url), "lease", exc)
            return None
        return taken

    async def release(self, store_keys: Sequence[bytes]) -> None:
        """Drop our leases once the values are written (waiters see the value first; a
        write that failed lets a waiter take the lease at once instead of at expiry)."""
        parts = self.parts
        if parts.lease is None or not store_keys or parts.policy.down():
            return  # a node backing off: the leases expire on their own
        try:
            await parts.client.delete_many([lease_key(k) for k in store_keys])
        except StoreError as exc:
            parts.policy.failed(NodeName(parts.client.safe_url), "lease", exc)

    async def wait_for_values(self, store_keys: Sequence[bytes], deadline: float | None = None
                              ) -> tuple[dict[bytes, Any], list[bytes]]:
        """Values of keys other processes hold leases on: polled until each one arrives,
        or its lease is free again (its holder died or gave up: then it is this
        process's to compute), or the deadline (default: ``lease`` seconds from now, plus
        the store's expiry slack: memcached expires whole seconds).

        Returns the values found and the keys this process must now compute.
        """
        parts = self.parts
        if deadline is None:
            deadline = time.monotonic() + (parts.lease or 0.0) + parts.client.expiry_slack
        counters = parts.counters.shard()
        counters["lease_waits"] += len(store_keys)
        found: dict[bytes, Any] = {}
        mine: list[bytes] = []
        pending = list(store_keys)
        delay, longest = LEASE_POLL
        while pending:
            values, error = await self.reads.values(pending, reread=True)
            still = []
            for key, value in zip(pending, values):
                if is_value(value):
                    found[key] = value
                else:
                    still.append(key)
            counters["lease_hits"] += len(pending) - len(still)
            if error is not None:  # the store is in trouble: compute the rest here
                mine += still
                break
            if not still:
                break
            more, got, pending = await self.claim(still)  # free again: the holder is gone
            found.update(more)
            mine += got
            remaining = deadline - time.monotonic()
            if pending and remaining <= 0:
                counters["lease_timeouts"] += len(pending)
                mine += pending
                break
            if pending:
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 1.5, longest)
        return found, mine

    async def run(self, keys: Sequence[bytes],
                  compute_mine: Callable[[list[bytes]], Awaitable[dict[bytes, Any]]]
                  ) -> Leased:
        """`lease_protocol` driven in the cache's loop; ``compute_mine(keys)`` computes,
        writes and releases (the `ComputeMine` step)."""
        steps = lease_protocol(keys)
        reply: Any = None
        try:
            while True:
                step = steps.send(reply)
                if type(step) is Claim:
                    reply = await self.claim(step.keys)
                elif type(step) is WaitFor:
                    reply = await self.wait_for_values(step.keys)
                else:
                    reply = await compute_mine(step.keys)
        except StopIteration as end:
            return end.value
