"""The store keys of pipe and node indices, pinned to the bytes main produced before the
decorator got its own argument encoding (issue 29): a cache written by an older version
must stay warm after an upgrade."""

from __future__ import annotations

import numpy as np
import pytest

from asynccache.cache.keys import Keyspace, chunk_keys, lease_key

PINNED = [
    (0, b"ac:ds-v1:0"),
    (7, b"ac:ds-v1:7"),
    (-3, b"ac:ds-v1:-3"),
    (2**40, b"ac:ds-v1:1099511627776"),
    (np.int64(5), b"ac:ds-v1:5"),
    ("cat.jpg", b"ac:ds-v1:s:cat.jpg"),
    ((1, "a"), b"ac:ds-v1:t:1:13:s:a"),
    (b"x", b"ac:ds-v1:b:x"),
    (None, b"ac:ds-v1:n:"),
]


@pytest.mark.parametrize(("index", "store_key"), PINNED)
def test_index_keys_are_the_bytes_of_main(index: object, store_key: bytes) -> None:
    assert Keyspace("ds-v1").key(index) == store_key


def test_lease_and_chunk_keys_are_the_bytes_of_main() -> None:
    key = Keyspace("ds-v1").key(7)
    assert lease_key(key) == b"ac:ds-v1:l:7"
    assert chunk_keys(key, "tok", 2) == [b"ac:ds-v1:c:tok:0:7", b"ac:ds-v1:c:tok:1:7"]
