"""mkdocs hook: the plots `asynccache bench` committed under ``bench/results/`` are served
as ``images/<name>.png``, so docs/performance.md shows the very files the benchmark wrote
(no second copy in ``docs/`` to fall out of date)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"images/{png.name}", abs_src_path=str(png)))
    return files
