"""``asynccache namespaces URL``: which namespaces a store holds, how large, how old.

A shared store fills with namespaces: one per dataset version, and one per pipe or node
built without ``namespace=`` (``anon-…``, expiring a day after their last write, never
read by another run). This lists them all from one ``scan`` of ``ac:`` (every node of a
pool, every primary of a cluster): keys and bytes per namespace, and for an unnamed one
the age its name records (`asynccache.cache.keys.unique_namespace`) and whether a pipe or
node on this machine has it open. ``asynccache flush URL --unnamed --older-than 6h``
removes the unnamed ones nobody can be using any more.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import time
from dataclasses import dataclass
from typing import Any

from ..cache.keys import namespace_prefix, unnamed, unnamed_since
from ..errors import StoreError
from ..observe.board import StatsBoard
from ..store.api import BaseClient
from ._common import (
    EXIT_OK,
    add_common_options,
    add_near_option,
    client_for,
    emit,
    failed,
    guarded,
    human_bytes,
    store_url,
    tiers_of,
)
from .stats import key_kind

__all__ = ["Usage", "add_arguments", "ages", "list_namespaces", "run"]

#: what every asynccache key starts with
ROOT = b"ac:"
#: keys under ac: that name no namespace (a store's own digest form of a long key)
UNATTRIBUTED = ""


@dataclass
class Usage:
    """What one namespace holds in one store."""

    namespace: str
    keys: int = 0
    bytes: int = 0
    values: int = 0
    chunks: int = 0
    leases: int = 0

    @property
    def unnamed(self) -> bool:
        return unnamed(self.namespace)

    @property
    def made(self) -> float | None:
        """When an unnamed namespace was made (Unix time), if its name says."""
        return unnamed_since(self.namespace)

    def document(self, now: float, open_here: int) -> dict[str, Any]:
        made = self.made
        return {"namespace": self.namespace, "keys": self.keys, "bytes": self.bytes,
                "values": self.values, "chunks": self.chunks, "leases": self.leases,
                "unnamed": self.unnamed,
                "made": None if made is None else _iso(made),
                "age_seconds": None if made is None else round(now - made, 1),
                "open_here": open_here}


def _iso(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat(
        timespec="seconds")


async def list_namespaces(client: BaseClient[Any]) -> dict[str, Usage]:
    """Every namespace under ``ac:`` in ``client``'s store (one scan), by name; keys that
    name none are under `UNATTRIBUTED`."""
    found: dict[str, Usage] = {}
    seen: set[bytes] = set()  # SCAN may list a key twice while the server rehashes
    async for page in client.scan(ROOT):
        for key, size in page:
            if key in seen:
                continue
            seen.add(key)
            name, sep, _rest = key[len(ROOT):].partition(b":")
            namespace = name.decode(errors="replace") if sep and name else UNATTRIBUTED
            usage = found.setdefault(namespace, Usage(namespace))
            usage.keys += 1
            usage.bytes += size or 0
            kind = key_kind(namespace_prefix(namespace), key) if namespace else "hashed"
            if kind == "value":
                usage.values += 1
            elif kind == "chunk":
                usage.chunks += 1
            elif kind == "lease":
                usage.leases += 1
    return found


def open_here(namespace: str) -> int:
    """Pipes and nodes of running processes on this machine that use ``namespace``."""
    return len(StatsBoard.labelled(namespace)) if namespace else 0


def ages(seconds: float) -> str:
    """``45 s``, ``12 min``, ``5.2 h``, ``3.0 d``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("List the namespaces a store holds (every key under ac:): keys and "
                          "bytes of each, unnamed ones (anon-...) marked with their age and "
                          "whether a process on this machine has them open.")
    parser.add_argument("url", metavar="URL", type=store_url, help="store URL")
    add_near_option(parser)
    add_common_options(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    return asyncio.run(_namespaces(args))


async def _namespaces(args: argparse.Namespace) -> int:
    client = client_for(args)
    listed: list[tuple[str | None, str, dict[str, Usage]]] = []
    where = client.safe_url
    try:
        for tier, store in tiers_of(client):
            where = store.safe_url
            listed.append((tier, store.safe_url, await list_namespaces(store)))
    except StoreError as exc:
        return failed(args, f"cannot list the keys under ac: on {where}: {exc}")
    finally:
        await client.close()
    now = time.time()
    stores = []
    for tier, url, found in listed:
        rows = sorted((u for name, u in found.items() if name != UNATTRIBUTED),
                      key=lambda u: (-u.bytes, u.namespace))
        other = found.get(UNATTRIBUTED)
        stores.append({"url": url, **({"tier": tier} if tier else {}),
                       "namespaces": [u.document(now, open_here(u.namespace)) for u in rows],
                       "unattributed_keys": other.keys if other else 0})
    document: dict[str, Any] = stores[0] if len(stores) == 1 else {"tiers": stores}
    emit(args, document, "\n\n".join(_text(store) for store in stores))
    return EXIT_OK


def _text(store: dict[str, Any]) -> str:
    rows = store["namespaces"]
    tier = f" ({store['tier']})" if "tier" in store else ""
    total = sum(r["bytes"] for r in rows)
    keys = sum(r["keys"] for r in rows)
    lines = [f"{len(rows):,} namespace{'s' if len(rows) != 1 else ''} on {store['url']}{tier}: "
             f"{keys:,} keys, {human_bytes(total)}"]
    width = max([len(r["namespace"]) for r in rows] + [9])
    for r in rows:
        if not r["unnamed"]:
            what = "named"
        elif r["age_seconds"] is None:
            what = "unnamed (an older release's: age unknown)"
        else:
            what = f"unnamed, made {ages(r['age_seconds'])} ago"
        if r["open_here"]:
            what += f", open here ({r['open_here']:,})"
        lines.append(f"  {r['namespace']:<{width}}  {r['keys']:>10,} keys  "
                     f"{human_bytes(r['bytes']):>10}  {what}")
    if store["unattributed_keys"]:
        lines.append(f"  ({store['unattributed_keys']:,} keys under ac: name no namespace)")
    return "\n".join(lines)
