"""A Redis Cluster's slot map flattened for the hot paths (`SlotView`), and what commands
are sent as (`Command`) and to (`Target`)."""

from __future__ import annotations

from binascii import crc_hqx
from collections.abc import Sequence
from dataclasses import dataclass

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from ..api import NodeName
from .connection import Request

__all__ = ["NO_VIEW", "Command", "SlotView", "Target", "key_slots"]

_SLOT_MASK = REDIS_CLUSTER_HASH_SLOTS - 1


def key_slots(keys: Sequence[bytes]) -> list[int]:
    """Each key's hash slot: redis-py's ``key_slot`` (the server's CRC16, of the ``{tag}``
    when there is one), with the common tag-free batch inlined (``binascii.crc_hqx`` is
    the C CRC16 that ``key_slot`` itself calls)."""
    if b"{" in b"".join(keys):
        return [key_slot(k) for k in keys]
    return [crc_hqx(k, 0) & _SLOT_MASK for k in keys]


@dataclass(frozen=True, slots=True)
class SlotView:
    """redis-py's slot map as of one refresh, flattened for lookups on the hot path (and
    replaced whole, so the consumer threads read a consistent one without a lock):
    ``owners[slot]`` is the primary's name (None: no node serves the slot)."""

    generation: int
    owners: tuple[NodeName | None, ...]
    primaries: dict[NodeName, tuple[str, int]]  # name -> (host, port)


NO_VIEW = SlotView(0, (None,) * REDIS_CLUSTER_HASH_SLOTS, {})


@dataclass(slots=True)
class Command:
    """One command about keys of one slot; ``positions`` index the caller's keys."""

    slot: int
    positions: Sequence[int]
    request: Request


@dataclass(frozen=True, slots=True)
class Target:
    """A node to send commands to: the slot's owner in the map, or where a ``MOVED`` /
    ``ASK`` reply sends them (``asking``: each command goes after an ``ASKING``)."""

    node: NodeName  # "host:port": the name failures are reported under
    host: str
    port: int
    asking: bool = False
