"""Every ``python`` block of README.md and docs/*.md runs as written, page by page, in
order, against this session's servers (tests/docs_pages.py says how, and which URLs it
substitutes); the DDP example runs under ``torchrun --nproc-per-node 2``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asynccache.testing import servers

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "docs_pages.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!-- skip: next(.*?)-->")
#: a skipped block says why, next to it; there are only a few
MAX_SKIPS = 4
SECRETS = {"ASYNCCACHE_SECRET": "docs-secret-0123456789abcdef0123",
           "ASYNCCACHE_OLD_SECRET": "docs-secret-fedcba9876543210fedc"}


@pytest.fixture
def page_env(redis_server: servers.RedisServer, memcached_server: servers.MemcachedServer,
             redis_cluster: servers.RedisCluster, tmp_path: Path) -> dict[str, str]:
    urls = {"redis": redis_server.url, "memcached": memcached_server.url,
            "cluster": redis_cluster.url}
    return {**os.environ, **SECRETS, "HOME": str(tmp_path),
            "ASYNCCACHE_DOCS_URLS": json.dumps(urls)}


def python_blocks(page: Path) -> int:
    return len(re.findall(r"^```python$", page.read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_block_of_a_page_runs(page: Path, page_env: dict[str, str],
                                    tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(RUNNER), str(page)], cwd=tmp_path,
                          env=page_env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    ran, skipped = map(int, re.findall(r"ran (\d+) blocks, skipped (\d+)", done.stdout)[-1])
    assert ran + skipped == python_blocks(page)  # the parser saw every block


def test_skips_are_few_and_say_why() -> None:
    reasons = [m.group(1).strip() for page in PAGES for m in SKIP.finditer(page.read_text())]
    assert len(reasons) <= MAX_SKIPS, reasons
    assert all(len(r) > 20 and r.startswith('"') and r.endswith('"') for r in reasons)
    assert sum(python_blocks(p) for p in PAGES) >= 20


def torchrun_block() -> str:
    text = (ROOT / "docs" / "pytorch.md").read_text()
    after = text.split('<!-- skip: next "a script for torchrun')[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_ddp_example_runs_under_torchrun(redis_server: servers.RedisServer,
                                             tmp_path: Path, namespace: str) -> None:
    sys.path.insert(0, str(RUNNER.parent))
    try:
        from docs_pages import substituted
    finally:
        sys.path.pop(0)
    script = tmp_path / "train.py"
    code = substituted(torchrun_block(), {"redis": redis_server.url})
    script.write_text(code.replace('namespace="squares-v1"', f'namespace="{namespace}"'))
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    hits: dict[str, Any] = dict(re.findall(r"rank (\d): (\d+) hits", done.stdout))
    assert set(hits) == {"0", "1"}, done.stdout
    # 3 epochs of 2,048 items a rank, in step (the barrier): the later two read what either
    # rank computed (4,096 hits); ranks that did not share would find only what they
    # computed themselves (~2,560). Without the barrier a rank that ran an epoch ahead
    # computed keys the other had not reached yet, and fell near that (2,607 in a CI run)
    assert all(int(n) >= 3_072 for n in hits.values()), hits
