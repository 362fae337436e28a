"""``asynccache flush URL --namespace NS``: delete one namespace, and nothing else; or
``--unnamed --older-than AGE``: the unnamed namespaces nobody can be using any more.

Everything asynccache keeps for a namespace is under ``ac:NS:`` (values, the chunks of
large values, leases: `asynccache.cache.keys`), so the keys are listed with the client's
``scan`` (every node of a pool, every primary of a cluster) and deleted in batches.
Never ``FLUSHDB``/``flush_all``: other namespaces and other applications share the store.

The prompt names the count and the prefix; ``--yes`` skips it. ``--json`` needs ``--yes``
(or ``--dry-run``): a script cannot answer a prompt, and deleting without being asked
must be said explicitly. With the prompt, the keys deleted are those counted for it;
keys written after the listing are left (run it again, or stop the writers first).

With ``--near NEAR_URL`` (a tiered client, `asynccache.Tiered`) both tiers are
flushed, far then near, and reported under ``"tiers"``. Each tier has its own prompt,
all asked before anything is deleted: a "no" to any of them deletes nothing, as it says.

``--unnamed`` finds the namespaces with `asynccache.cli.namespaces` (one scan of ``ac:``)
and reads each unnamed one's age from its name; one a pipe or node on this machine has
open is kept (a job on another machine cannot be seen: its next reads miss and compute
again, never read something wrong).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from ..cache.keys import namespace_prefix
from ..errors import StoreError
from ..store.api import BaseClient
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    add_common_options,
    add_near_option,
    client_for,
    duration,
    emit,
    failed,
    guarded,
    namespace_arg,
    store_url,
    tiers_of,
    usage_error,
)
from .namespaces import Usage, ages, list_namespaces, open_here

__all__ = ["add_arguments", "run"]

#: keys per delete_many call
DELETE_BATCH = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Delete every key of one namespace (values, chunks, leases: all "
                          "of ac:NS:*) from a store, after a confirmation prompt.")
    parser.add_argument("url", metavar="URL", type=store_url, help="store URL")
    parser.add_argument("--namespace", "-n", type=namespace_arg,
                        help="the namespace to delete (its keys are ac:NS:*)")
    parser.add_argument("--unnamed", action="store_true",
                        help="instead: every unnamed namespace (anon-..., of pipes and nodes "
                        "built without namespace=) made over --older-than ago, except those "
                        "a process on this machine has open")
    parser.add_argument("--older-than", type=duration, metavar="AGE", default=None,
                        help="with --unnamed: an age, e.g. 90m, 6h, 2d (or seconds)")
    parser.add_argument("--yes", "-y", action="store_true",
                        help="do not ask for confirmation (required with --json)")
    parser.add_argument("--dry-run", action="store_true",
                        help="only count the keys that would be deleted")
    add_near_option(parser)
    add_common_options(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    if args.json and not (args.yes or args.dry_run):
        return usage_error(args, "--json needs --yes (or --dry-run): a script cannot answer "
                           "the confirmation prompt")
    if (args.namespace is None) == (not args.unnamed):
        return usage_error(args, "name what to delete: --namespace NS, or --unnamed "
                           "--older-than AGE")
    if args.unnamed != (args.older_than is not None):
        return usage_error(args, "--unnamed and --older-than AGE go together (e.g. --unnamed "
                           "--older-than 1d)")
    if args.unnamed:
        return asyncio.run(_flush_unnamed(args))
    return asyncio.run(_flush(args))


async def _flush(args: argparse.Namespace) -> int:
    client = client_for(args)
    prefix = namespace_prefix(args.namespace)
    where = {"url": client.safe_url, "namespace": args.namespace, "prefix": prefix.decode()}
    tiers: dict[str, dict[str, Any]] = {}
    try:
        stores = tiers_of(client)  # with --near: far (the URL), then near
        listed = [await _listed_and_confirmed(args, store, prefix) for _tier, store in stores]
        if any(keys is False for keys in listed):
            print("nothing deleted", file=sys.stderr)
            return EXIT_FAILED
        for (tier, store), keys in zip(stores, listed):
            done = await _flush_one(args, store, prefix, keys)
            if tier is not None:
                tiers[tier] = {"url": store.safe_url, **done}
    except StoreError as exc:
        return failed(args, f"flush of {prefix.decode()} on {client.safe_url} failed: {exc}",
                      **where)
    finally:
        await client.close()
    document: dict[str, Any] = {**where, **done}
    if tiers:
        document = {**where, "keys": sum(t["keys"] for t in tiers.values()),
                    "deleted": sum(t["deleted"] for t in tiers.values()), "tiers": tiers}
    if args.dry_run:
        text = "\n".join(f"{t['keys']:,} keys under {prefix.decode()} on {t['url']}"
                         for t in _listed(tiers, document)) + " (dry run: nothing deleted)"
    else:
        text = "\n".join(f"deleted {t['deleted']:,} keys under {prefix.decode()} on {t['url']}"
                         for t in _listed(tiers, document))
    emit(args, document, text)
    return EXIT_OK


def _listed(tiers: dict[str, dict[str, Any]], document: dict[str, Any]
            ) -> list[dict[str, Any]]:
    return list(tiers.values()) if tiers else [document]


async def _listed_and_confirmed(args: argparse.Namespace, client: BaseClient[Any],
                                prefix: bytes) -> list[bytes] | bool:
    """One store's keys, listed for the prompt (or ``--dry-run``) and confirmed; False
    when the user said no; True with ``--yes`` (listed while deleting, `_delete_as_listed`)."""
    if args.yes and not args.dry_run:
        return True
    keys = await _list(client, prefix)
    if not args.dry_run and keys and not _confirm(len(keys), prefix, client.safe_url):
        return False
    return keys


async def _flush_one(args: argparse.Namespace, client: BaseClient[Any], prefix: bytes,
                     keys: list[bytes] | bool) -> dict[str, int]:
    """One store, its keys confirmed (`_listed_and_confirmed`): {"keys": listed,
    "deleted": deleted}."""
    if keys is True:
        deleted = await _delete_as_listed(client, prefix)
        return {"keys": deleted, "deleted": deleted}
    assert keys is not False  # a "no" returned before anything was deleted
    if args.dry_run:
        return {"keys": len(keys), "deleted": 0}
    return {"keys": len(keys), "deleted": await _delete(client, keys)}


async def _list(client: BaseClient[Any], prefix: bytes) -> list[bytes]:
    found: dict[bytes, None] = {}  # a key listed twice (SCAN during a rehash) counts once
    async for page in client.scan(prefix):
        found.update(dict.fromkeys(key for key, _size in page))
    return list(found)


async def _delete(client: BaseClient[Any], keys: list[bytes]) -> int:
    for start in range(0, len(keys), DELETE_BATCH):
        await client.delete_many(keys[start:start + DELETE_BATCH])
    return len(keys)


async def _delete_as_listed(client: BaseClient[Any], prefix: bytes) -> int:
    """Delete page by page while listing: keys written meanwhile are caught too. (The
    set only keeps the count exact when SCAN lists a key twice.)"""
    deleted: set[bytes] = set()
    async for page in client.scan(prefix, batch=DELETE_BATCH):
        keys = [key for key, _size in page if key not in deleted]
        if keys:
            await client.delete_many(keys)
            deleted.update(keys)
    return len(deleted)


def _confirm(count: int, prefix: bytes, url: str) -> bool:
    """Ask on stderr (stdout stays the result's); anything but y/yes, or no terminal
    input at all, is no."""
    return _confirm_what(f"{count:,} keys under {prefix.decode()}", url)


# -- --unnamed --older-than AGE ----------------------------------------------------------------
async def _flush_unnamed(args: argparse.Namespace) -> int:
    """Every unnamed namespace made over ``--older-than`` ago (its name says when), except
    one a process on this machine has open (a long job's: it would only recompute) and
    one of an older release (its name holds no time; its values expire a day after their
    last write anyway). Each tier listed and confirmed before anything is deleted."""
    client = client_for(args)
    now = time.time()
    chosen: list[tuple[BaseClient[Any], list[Usage], dict[str, Any]]] = []
    try:
        for tier, store in tiers_of(client):
            found = await list_namespaces(store)
            old = [u for u in found.values()
                   if u.made is not None and now - u.made > args.older_than]
            kept = [u.namespace for u in old if open_here(u.namespace)]
            old = [u for u in old if u.namespace not in kept]
            report = {"url": store.safe_url, **({"tier": tier} if tier else {}),
                      "namespaces": [u.namespace for u in old],
                      "keys": sum(u.keys for u in old), "deleted": 0, "kept_open_here": kept,
                      "age_unknown": sum(1 for u in found.values()
                                         if u.unnamed and u.made is None)}
            chosen.append((store, old, report))
        if not args.dry_run and not args.yes:
            for store, old, report in chosen:
                what = (f"{len(old):,} unnamed namespaces made over {ages(args.older_than)} "
                        f"ago ({report['keys']:,} keys)")
                if old and not _confirm_what(what, store.safe_url):
                    print("nothing deleted", file=sys.stderr)
                    return EXIT_FAILED
        if not args.dry_run:
            for store, old, report in chosen:
                report["deleted"] = sum([await _delete_as_listed(
                    store, namespace_prefix(usage.namespace)) for usage in old])
    except StoreError as exc:
        return failed(args, f"flush of unnamed namespaces on {client.safe_url} failed: {exc}")
    finally:
        await client.close()
    reports = [report for _store, _old, report in chosen]
    document: dict[str, Any] = {"older_than_seconds": args.older_than,
                                **(reports[0] if len(reports) == 1 else {"tiers": reports})}
    emit(args, document, "\n".join(_unnamed_line(r, args.dry_run) for r in reports))
    return EXIT_OK


def _unnamed_line(report: dict[str, Any], dry_run: bool) -> str:
    done = (f"{len(report['namespaces']):,} unnamed namespaces, {report['keys']:,} keys, "
            f"would be deleted (dry run)" if dry_run else
            f"deleted {report['deleted']:,} keys of {len(report['namespaces']):,} unnamed "
            f"namespaces")
    line = f"{done} on {report['url']}"
    if report["kept_open_here"]:
        line += f"; kept {len(report['kept_open_here']):,} open on this machine"
    return line


def _confirm_what(what: str, url: str) -> bool:
    """Ask whether to delete ``what`` on ``url``: see `_confirm`."""
    sys.stderr.write(f"delete {what} on {url}? [y/N] ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")
