"""``asynccache stats URL --namespace NS``: what a namespace holds, and how well it serves.

Two sources, because they answer different questions:

* the **store**: every key under ``ac:NS:`` (``SCAN`` on every node or primary, memcached's
  ``lru_crawler metadump``), counted as values, chunks and leases, with the bytes of
  their values;
* the **processes on this machine** that use the namespace (pipes and nodes, their
  DataLoader workers included): the counters they publish to their stats boards
  (`asynccache.observe.board`), summed. That is the hit rate of the running jobs here; jobs
  on other machines report on theirs. The counts come from running processes and from
  ones that already exited (non-persistent DataLoader workers leave their final
  counters behind while the job runs): ``"processes"`` counts the running ones,
  ``"exited_processes"`` the others. No job here: ``"boards": 0``.

With ``--near NEAR_URL`` (a tiered client, `asynccache.Tiered`) each tier is listed
on its own: the URL's counts as without it, near's under ``"near"``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..cache.keys import namespace_prefix
from ..errors import StoreError
from ..observe.board import StatsBoard
from ..observe.board import _alive as alive
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
    namespace_arg,
    store_url,
    tiers_of,
)

__all__ = ["add_arguments", "key_kind", "local_counters", "run"]

#: Counters summed from the boards and shown in the output (all are in "counters").
SHOWN = ("hits", "misses", "errors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Number of keys and bytes under a namespace in the store, and the "
                          "hit rate (hits, misses, errors) that the processes on this "
                          "machine using that namespace report.")
    parser.add_argument("url", metavar="URL", type=store_url, help="store URL")
    parser.add_argument("--namespace", "-n", required=True, type=namespace_arg,
                        help="the namespace of the pipe or node (its keys are ac:NS:*)")
    add_near_option(parser)
    add_common_options(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    return asyncio.run(_stats(args))


def key_kind(prefix: bytes, key: bytes) -> str:
    """``value``, ``chunk`` or ``lease`` by the tag after the prefix (see
    `asynccache.cache.keys`); ``hashed`` for a key the store holds in digest form
    (memcached, a key it could not take verbatim), whose kind cannot be told."""
    if not key.startswith(prefix):
        return "hashed"
    rest = key[len(prefix):]
    if rest.startswith(b"c:"):
        return "chunk"
    if rest.startswith(b"l:"):
        return "lease"
    return "hashed" if rest.startswith(b"#") else "value"


async def _count(client: BaseClient[Any], prefix: bytes) -> dict[str, Any]:
    kinds = dict.fromkeys(("value", "chunk", "lease", "hashed"), 0)
    seen: set[bytes] = set()  # SCAN may list a key twice while the server rehashes
    total_bytes = unknown = 0
    async for page in client.scan(prefix):
        for key, size in page:
            if key in seen:
                continue
            seen.add(key)
            kinds[key_kind(prefix, key)] += 1
            if size is None:
                unknown += 1
            else:
                total_bytes += size
    return {"url": client.safe_url, "keys": len(seen), "bytes": total_bytes,
            "values": kinds["value"], "chunks": kinds["chunk"], "leases": kinds["lease"],
            "hashed": kinds["hashed"], "unknown_sizes": unknown}


def local_counters(namespace: str) -> dict[str, Any]:
    """The counters that the processes on this machine report for ``namespace``, summed:
    ``boards`` (open pipes or nodes), ``processes`` (reporting and still running),
    ``exited_processes`` (reported, then exited: their final numbers are included);
    ``ignored_files``: board files that did not parse (not summed)."""
    total: dict[str, int] = {}
    live: set[int] = set()
    exited: set[int] = set()
    boards = StatsBoard.labelled(namespace)
    for board in boards:
        for pid, counters in board.collect().items():
            (live if alive(pid) else exited).add(pid)
            for name, value in counters.items():
                total[name] = total.get(name, 0) + value
    hits = total.get("hits", 0)
    reads = hits + total.get("misses", 0) + total.get("recalled", 0)
    return {
        "processes": len(live),
        "exited_processes": len(exited - live),
        "boards": len(boards),
        "ignored_files": sum(board.errors for board in boards),
        **{name: total.get(name, 0) for name in SHOWN},
        "hit_rate": hits / reads if reads else None,
        "counters": total,
    }


async def _stats(args: argparse.Namespace) -> int:
    prefix = namespace_prefix(args.namespace)
    client = client_for(args)
    counted: dict[str | None, dict[str, Any]] = {}
    where = client.safe_url
    try:
        for tier, store in tiers_of(client):  # with --near: each tier on its own
            where = store.safe_url
            counted[tier] = await _count(store, prefix)
    except StoreError as exc:
        return failed(args, f"cannot list {prefix.decode()} on {where}: {exc}",
                      namespace=args.namespace)
    finally:
        await client.close()
    document = {**counted.get(None, counted.get("far", {})), "namespace": args.namespace,
                "prefix": prefix.decode(), **local_counters(args.namespace)}
    if "near" in counted:  # the URL's counts above are far's; near's apart
        document["near"] = counted["near"]
    emit(args, document, _text(document))
    return EXIT_OK


def _store_line(doc: dict[str, Any], prefix: str, tier: str = "") -> str:
    parts = [f"{doc['values']:,} values", f"{doc['chunks']:,} chunks",
             f"{doc['leases']:,} leases"]
    if doc["hashed"]:
        parts.append(f"{doc['hashed']:,} in memcached's digest form")
    return (f"{prefix} on {doc['url']}{tier}: {doc['keys']:,} keys, "
            f"{human_bytes(doc['bytes'])} ({', '.join(parts)})")


def _text(doc: dict[str, Any]) -> str:
    near = doc.get("near")
    lines = [_store_line(doc, doc["prefix"], " (far)" if near else "")]
    if near:
        lines.append(_store_line(near, doc["prefix"], " (near)"))
    lines.append(_reporters(doc))
    if doc["ignored_files"]:
        lines.append(f"({doc['ignored_files']:,} stats board files that did not parse were "
                     "ignored)")
    return "\n".join(lines)


def _count_of(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _reporters(doc: dict[str, Any]) -> str:
    """Who the hit rate comes from, in words that fit the counts (never "0 running")."""
    namespace = doc["namespace"]
    running, exited = doc["processes"], doc.get("exited_processes", 0)
    if not doc["boards"]:
        return (f"no process on this machine has namespace {namespace!r} open "
                "(no hit rate here)")
    if not running and not exited:
        return (f"no process has reported yet "
                f"({_count_of(doc['boards'], 'pipe or node', 'pipes or nodes')} open "
                f"for {namespace!r})")
    if exited and running:
        source = (f"{_count_of(running + exited, 'process', 'processes')} "
                  f"({running:,} running, {exited:,} exited)")
    elif running:
        source = _count_of(running, "running process", "running processes")
    else:
        source = _count_of(exited, "exited process", "exited processes")
    rate = "-" if doc["hit_rate"] is None else f"{doc['hit_rate']:.1%}"
    return (f"hit rate {rate} (hits {doc['hits']:,}, misses {doc['misses']:,}, errors "
            f"{doc['errors']:,}) from {source} on this machine")
