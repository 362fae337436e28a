"""The store administration commands: ``ping``, ``stats``, ``flush``, ``warm``, ``serve``.

One module per command, each with ``add_arguments(parser)`` and ``run(args) -> int``, as
:mod:`asynccache.__main__` expects. They share :mod:`asynccache.cli._common`: the
argument types (a bad URL or namespace is a usage error, exit 2, caught by argparse
before anything connects), ``--json`` output (one document on stdout, everything else
on stderr) and the exit codes scripts rely on: 0 ok, 1 failed, 2 usage.
"""
