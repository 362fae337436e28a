"""``asynccache ping URL``: is the store there, how far away is it, what is it.

The first round trip also opens the connections (and reads a cluster's slot map), so it
is reported apart (``first_ms``); ``min``/``median`` are over the ``--count`` pings after
it. A pool or cluster is pinged on every node at once: one ping costs the slowest node.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from ..errors import StoreError
from ._common import (
    EXIT_OK,
    add_common_options,
    client_for,
    emit,
    failed,
    guarded,
    human_bytes,
    positive_int,
    store_url,
)

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Round-trip time to a store (min and median of a few pings), the "
                          "server and version of each node and the item size limit. Exit "
                          "code 1 when the store does not answer.")
    parser.add_argument("url", metavar="URL", type=store_url,
                        help="store URL, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--count", type=positive_int, default=5,
                        help="pings after the first one (default 5)")
    add_common_options(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    return asyncio.run(_ping(args))


async def _ping(args: argparse.Namespace) -> int:
    client = client_for(args)
    url = client.safe_url
    try:
        started = time.perf_counter()
        await client.ping()
        first = _ms(started)
        times = []
        for _ in range(args.count):
            started = time.perf_counter()
            await client.ping()
            times.append(_ms(started))
        info = await client.server_info()
    except StoreError as exc:
        return failed(args, f"cannot reach {url}: {exc}", url=url)
    finally:
        await client.close()
    document: dict[str, Any] = {
        "url": url,
        "pings": len(times),
        "rtt_ms": {"min": min(times), "median": statistics.median(times), "first": first},
        "max_value_size": info.get("max_value_size"),
        "nodes": info.get("nodes", {}),
    }
    emit(args, document, _text(document))
    return EXIT_OK


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


def _text(doc: dict[str, Any]) -> str:
    rtt = doc["rtt_ms"]
    nodes = doc["nodes"]
    limit = doc["max_value_size"]
    lines = [
        f"{doc['url']}: answered ({len(nodes) or 1} node{'s' if len(nodes) > 1 else ''})",
        f"  round trip: min {rtt['min']:.3f} ms, median {rtt['median']:.3f} ms over "
        f"{doc['pings']} pings (first, connecting: {rtt['first']:.3f} ms)",
        "  largest value in one item: "
        + ("no limit" if limit is None else f"{human_bytes(limit)} (larger values are chunked)"),
    ]
    for name, node in nodes.items():
        parts = [f"{node.get('server', '?')} {node.get('version') or '?'}"]
        if node.get("item_size") is not None:
            parts.append(f"item size {human_bytes(node['item_size'])}")
        if node.get("used_memory") is not None:
            parts.append(f"memory used {human_bytes(node['used_memory'])}")
        lines.append(f"  {name}: " + ", ".join(parts))
    return "\n".join(lines)
