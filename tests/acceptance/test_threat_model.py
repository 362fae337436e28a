"""The threat model (docs/security.md) names, for every limit it claims, a test that shows it: each
one cited must exist (a renamed or deleted test would leave a claim unbacked)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_threat_model_cites_exists() -> None:
    readme = (ROOT / "docs" / "security.md").read_text()
    section = readme[readme.index("## Threat model"):readme.index("## What a store writer")]
    cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", section)
    assert len(cited) >= 20
    for who in ("a writer of the store", "another local user", "a network attacker",
                "a provider"):
        assert f"**{who}**" in section
    missing = [f"{path}::{name}" for path, name in cited
               if not re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text(), re.M)]
    assert not missing
