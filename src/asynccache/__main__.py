"""The ``asynccache`` command line (also ``python -m asynccache``).

Each command lives in its own module with two functions, ``add_arguments(parser)`` and
``run(args) -> int``. A module is imported only when its command is chosen, so
``asynccache --help`` does not pay for numpy, tqdm or a server lookup.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__
from .errors import CacheError, MissingDependency
from .store.credentials import mask_text, mask_url

__all__ = ["COMMANDS", "main"]

#: command name -> (module, one-line summary shown by ``asynccache --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "asynccache.cli.demo",
        "cold and warm DataLoader epochs without a cache, with a per-worker dict "
        "and with async_kv_cache on a private Redis-compatible server",
    ),
}
COMMANDS["bench"] = ("asynccache.bench.cli", "benchmarks against peers: tables, JSON, plots")
COMMANDS["ping"] = ("asynccache.cli.ping", "round-trip time, server versions and item size "
                    "limit of a store")
COMMANDS["stats"] = ("asynccache.cli.stats", "keys and bytes of a namespace in a store, and "
                     "its hit rate in the processes of this machine")
COMMANDS["namespaces"] = ("asynccache.cli.namespaces", "the namespaces a store holds: keys, "
                          "bytes, unnamed ones with their age")
COMMANDS["flush"] = ("asynccache.cli.flush", "delete one namespace's keys (values, chunks, "
                     "leases) from a store")
COMMANDS["warm"] = ("asynccache.cli.warm", "fill a store from a map-style dataset, in "
                    "parallel, resumably")
COMMANDS["serve"] = ("asynccache.cli.serve", "run a local redis, valkey or memcached for "
                     "development until Ctrl-C")

#: a command's optional imports -> the extra that installs them
EXTRA_FOR_COMMAND = {"demo": "demo", "bench": "bench"}

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT
EXIT_BROKEN_PIPE = 141  # the shell's code for SIGPIPE: the reader of stdout went away


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The first positional argument (the top-level parser has no valued options)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors never show a password: argparse quotes the
    offending argument as typed (``unrecognized arguments: ...``, ``invalid ... value``),
    so every argument that holds one is masked in the message."""

    secrets: tuple[tuple[str, str], ...] = ()

    def error(self, message: str) -> NoReturn:
        for raw, masked in self.secrets:
            message = message.replace(raw, masked)
        super().error(mask_text(message))


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; only the command named in ``argv`` gets its module imported."""
    _Parser.secrets = tuple((arg, mask_url(arg)) for arg in argv if mask_url(arg) != arg)
    parser = _Parser(
        prog="asynccache",
        description="asynccache: a shared key-value cache with batched prefetching "
        "for PyTorch data loading.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen_command(argv)
    for name, (_module, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        if name == chosen:
            _command_module(name).add_arguments(sub)
    return parser


def _command_module(name: str) -> Any:
    """The command's module; a missing optional dependency names the extra to install."""
    try:
        return importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as exc:
        raise _missing(name, exc) from exc


def _missing(command: str, exc: ModuleNotFoundError) -> Exception:
    """MissingDependency naming the extra for a third-party module; ``exc`` itself for
    one of ours (a bug, not an installation problem)."""
    package = (exc.name or "").split(".")[0]
    if not package or package == "asynccache":
        return exc
    extra = EXTRA_FOR_COMMAND.get(command)
    hint = f"pip install 'asynccache[{extra}]'" if extra else f"pip install {package}"
    return MissingDependency(
        f"`asynccache {command}` needs the package {package!r}, which is not installed: "
        f"{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code. Output into a pipe whose reader has gone
    (``asynccache stats ... | head -1``) ends the command quietly, as other tools do."""
    try:
        try:
            code = _main(list(sys.argv[1:] if argv is None else argv))
        finally:  # here, not at exit (nor after argparse's --help): a closed pipe is then
            sys.stdout.flush()  # one this handler sees
    except BrokenPipeError:
        # nothing more can reach the reader, and the interpreter's own flush at exit must
        # not print a traceback either: what is left goes nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return code


def _main(argv: list[str]) -> int:
    try:
        args = build_parser(argv).parse_args(argv)
        module = _command_module(args.command)
    except MissingDependency as exc:
        print(f"asynccache: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return int(module.run(args))
    except KeyboardInterrupt:
        print(f"asynccache {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ModuleNotFoundError as exc:  # imported lazily by the command, e.g. matplotlib
        missing = _missing(args.command, exc)
        if not isinstance(missing, MissingDependency):
            raise
        print(f"asynccache {args.command}: error: {missing}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        if not isinstance(exc, CacheError) and not _testing_error(exc):
            raise
        print(f"asynccache {args.command}: error: {mask_text(str(exc))}", file=sys.stderr)
        return EXIT_ERROR


def _testing_error(exc: BaseException) -> bool:
    """A failure of asynccache.testing (a server that would not start): only a command
    that imported it can raise one, so the command line does not import it up front."""
    servers = sys.modules.get("asynccache.testing.servers")
    return servers is not None and isinstance(exc, servers.TestingError)


if __name__ == "__main__":
    sys.exit(main())
