"""Moved to ``asynccache bench --only datapipe`` (``src/asynccache/bench/datapipe.py``).

    python -m bench.bench_datapipe [--quick] [--out DIR] [--reps N]

forwards its arguments to that command (the profile of the ``dp[i]`` path is part of a
full run; ``--profile-only`` is gone).
"""

from __future__ import annotations

import sys

from asynccache.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "datapipe", *sys.argv[1:]]))
