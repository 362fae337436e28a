"""The true/false words of URL options: one rule for connect() and lmdb://."""

from __future__ import annotations

import pytest

import asynccache as ac
from asynccache.store.url_options import flag


@pytest.mark.parametrize("word", ["true", "1", "yes", "on", " TRUE ", "On", True])
def test_words_for_true(word: object) -> None:
    assert flag("tls", word) is True


@pytest.mark.parametrize("word", ["false", "0", "no", "off", "No", False])
def test_words_for_false(word: object) -> None:
    assert flag("tls", word) is False


def test_another_word_is_refused_naming_the_option_and_where() -> None:
    with pytest.raises(ac.InvalidURL, match=r"option tls='maybe' for redis://h:1/0 is not "
                                            r"true or false"):
        flag("tls", "maybe", "redis://h:1/0")
    with pytest.raises(ac.InvalidURL, match=r"^option sync='2' is not true or false$"):
        flag("sync", "2")


def test_connect_and_lmdb_take_the_same_words(tmp_path: object) -> None:
    with pytest.raises(ac.InvalidURL, match="option tls='maybe' for redis://"):
        ac.connect("redis://127.0.0.1:1/0?tls=maybe")
    with pytest.raises(ac.InvalidURL, match="option sync='maybe'"):
        ac.connect(f"lmdb://{tmp_path}/env?sync=maybe")
