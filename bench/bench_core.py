"""Moved to ``asynccache bench --only core`` (``src/asynccache/bench/core.py``).

    python -m bench.bench_core [--quick] [--out DIR] [--reps N]

forwards its arguments to that command.
"""

from __future__ import annotations

import sys

from asynccache.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "core", *sys.argv[1:]]))
