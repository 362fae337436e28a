"""What every store command shares: argument types, ``--json`` output, exit codes.

Why argument *types* check URLs and namespaces: argparse then reports them like any
other usage error (one line, exit 2) before the command connects to anything, and the
commands never have to tell "you typed it wrong" from "the store failed" later.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

from ..cache.keys import check_namespace
from ..errors import CacheError, ConfigError, StoreError, Unsupported
from ..store.api import BaseClient
from ..store.connect import connect
from ..store.credentials import mask_text, mask_url
from ..store.tiered import Tiered

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "add_common_options",
    "add_near_option",
    "client_for",
    "duration",
    "emit",
    "failed",
    "guarded",
    "human_bytes",
    "namespace_arg",
    "positive_float",
    "positive_int",
    "store_url",
    "tiers_of",
    "usage_error",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # argparse's own code for usage errors


def store_url(text: str) -> str:
    """An argparse type: ``text`` if ``connect()`` accepts it (no I/O happens). Any
    refusal is an ArgumentTypeError with the password masked (argparse would print the
    raw value for any other exception)."""
    try:
        connect(text)
    except Exception as exc:
        message = str(exc) if isinstance(exc, CacheError) else (
            f"{mask_url(text)!r} is not a usable store URL ({type(exc).__name__}: "
            f"{mask_text(str(exc))})")
        raise argparse.ArgumentTypeError(mask_text(message)) from None
    return text


def namespace_arg(text: str) -> str:
    """An argparse type: a namespace ``check_namespace`` accepts (never empty)."""
    try:
        return check_namespace(text)
    except CacheError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not above 0")
    return value


_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """An argparse type: an age or a span, ``90s``, ``30m``, ``6h``, ``2d`` or seconds."""
    number = text.strip().lower()
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if number.endswith(u)), "")
    try:
        value = float(number[:len(number) - len(unit)]) * _UNITS.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: write e.g. 90m, 6h, 2d or a number of seconds"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not above 0")
    return value


def add_common_options(parser: argparse.ArgumentParser, *, timeout: bool = True) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout (and nothing else there)")
    if timeout:
        parser.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                            help="bound on each store operation and on connecting "
                            "(default: the URL's timeout= or 1 s)")


def add_near_option(parser: argparse.ArgumentParser) -> None:
    """``--near URL``: the command works on ``Tiered(near, URL)``, each tier reported."""
    parser.add_argument("--near", metavar="NEAR_URL", type=store_url, default=None,
                        help="the store of this machine in front of URL (asynccache.Tiered"
                        "(near, far)): both tiers, each reported")


def client_for(args: argparse.Namespace) -> BaseClient[Any]:
    """The client for ``args.url``, with ``--timeout`` applied when given; with
    ``--near``, ``Tiered(near, url)``."""
    seconds = getattr(args, "timeout", None)  # None: the URL's, else the default
    client = connect(args.url, timeout=seconds, connect_timeout=seconds)
    near = getattr(args, "near", None)
    return client if near is None else Tiered(
        connect(near, timeout=seconds, connect_timeout=seconds), client)


def tiers_of(client: BaseClient[Any]) -> list[tuple[str | None, BaseClient[Any]]]:
    """``[("far", far), ("near", near)]`` of a tiered client (far first: a flush then
    leaves nothing a read on this machine could copy back into near), else
    ``[(None, client)]``."""
    if isinstance(client, Tiered):
        return [("far", client.far), ("near", client.near)]
    return [(None, client)]


def emit(args: argparse.Namespace, document: dict[str, Any], text: str) -> None:
    """The command's result: ``document`` as JSON with ``--json``, else ``text``."""
    if args.json:
        print(json.dumps({"ok": True, **document}, sort_keys=False))
    else:
        print(text)
    sys.stdout.flush()


def failed(args: argparse.Namespace, message: str, **document: Any) -> int:
    """Say what failed on stderr (and as ``{"ok": false, "error": ...}`` with ``--json``);
    exit code 1."""
    message = mask_text(message)  # a net: messages carry safe_url, never the password
    print(f"asynccache {args.command}: error: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"ok": False, "error": message, **document}))
    return EXIT_FAILED


def usage_error(args: argparse.Namespace, message: str) -> int:
    """A mistake in the command line found after parsing: one line, exit code 2."""
    print(f"asynccache {args.command}: error: {mask_text(message)}", file=sys.stderr)
    return EXIT_USAGE


def guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` with the exit codes applied: a ConfigError (for the user to fix) is a usage
    error, 2; a StoreError, or a store that cannot do it (Unsupported: the command line
    was right), is a failure, 1; each one line, no traceback."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except Unsupported as exc:
            return failed(args, str(exc))
        except ConfigError as exc:
            return usage_error(args, str(exc))
        except StoreError as exc:
            return failed(args, str(exc))

    return wrapper


def human_bytes(size: int | None) -> str:
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
