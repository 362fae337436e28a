"""Every Python block of the docs marked ``<!-- test: run -->`` runs as written (the
decorator's reference in async-services.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
MARKED = re.compile(r"<!-- test: run -->\n```python\n(.*?)```", re.S)
BLOCKS = [(page.name, i, code) for page in sorted(DOCS.glob("*.md"))
          for i, code in enumerate(MARKED.findall(page.read_text()))]


def test_there_are_marked_blocks() -> None:
    assert {name for name, _i, _code in BLOCKS} >= {"async-services.md"}


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS,
                         ids=[f"{name}-{i}" for name, i, _code in BLOCKS])
def test_a_marked_block_runs(page: str, index: int, code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, f"{page} block {index}:\n{done.stderr}"
