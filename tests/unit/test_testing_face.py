"""`asynccache.testing`'s public names are the ones its reference page documents."""

from __future__ import annotations

import re
from pathlib import Path

import asynccache.testing as testing

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "testing.md"


def documented() -> set[str]:
    """The names the page renders: each ``::: module.Name`` and each listed member."""
    text = PAGE.read_text()
    names = set()
    for target in re.findall(r"^::: ([\w.]+)$", text, re.M):
        if target != "asynccache.testing.servers":  # the module: its members are listed
            names.add(target.rsplit(".", 1)[1])
    names.update(re.findall(r"^        - (\w+)$", text, re.M))
    return names


def test_the_reference_page_documents_exactly_the_public_names() -> None:
    assert documented() == set(testing.__all__)


def test_every_public_name_is_importable() -> None:
    for name in testing.__all__:
        assert getattr(testing, name) is not None
