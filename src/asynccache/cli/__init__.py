"""The commands: ``demo`` and the store administration ones, ``ping``, ``stats``,
``flush``, ``warm``, ``serve`` (``bench`` lives with the benchmarks, `asynccache.bench`).

One module per command, each with ``add_arguments(parser)`` and ``run(args) -> int``, as
`asynccache.__main__` expects. They share `asynccache.cli._common`: the
argument types (a bad URL or namespace is a usage error, exit 2, caught by argparse
before anything connects), ``--json`` output (one document on stdout, everything else
on stderr) and the exit codes scripts rely on: 0 ok, 1 failed, 2 usage. Long commands
show progress with `asynccache.cli.progress`. A command module imports only the standard
library and asynccache's own dependencies at the top, so its ``--help`` works without
its extra.
"""
