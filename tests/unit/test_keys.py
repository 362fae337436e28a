"""The documented key encoding: injective across types, stable, clear about refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import asynccache as ac
from asynccache.cache.keys import check_namespace, encode_key, namespace_prefix

atoms = st.one_of(st.integers(), st.text(), st.binary(), st.none())
keys = st.recursive(atoms, lambda inner: st.tuples(inner, inner) | st.tuples(inner),
                    max_leaves=6)


def canonical(key: object) -> object:
    """What a key means: True and 1 are one key, as in a dict."""
    if isinstance(key, tuple):
        return ("tuple", tuple(canonical(k) for k in key))
    if isinstance(key, bool | int):
        return ("int", int(key))
    return (type(key).__name__, key)


def test_documented_examples() -> None:
    assert encode_key(42) == b"42" and encode_key(-3) == b"-3"
    assert encode_key("cat.jpg") == b"s:cat.jpg"
    assert encode_key(b"\x00\x01") == b"b:\x00\x01"
    assert encode_key((1, "a")) == b"t:1:13:s:a"
    assert encode_key(None) == b"n:" and encode_key((None, 1)) == b"t:2:n:1:1"
    assert namespace_prefix("ds-v1") == b"ac:ds-v1:"


def test_integer_likes_share_the_int_key() -> None:
    for value in (np.int64(7), np.uint8(7), torch.tensor(7), torch.tensor([7])[0], True * 7):
        assert encode_key(value) == b"7"


@given(keys, keys)
def test_injective(a: object, b: object) -> None:
    if canonical(a) != canonical(b):
        assert encode_key(a) != encode_key(b)
    else:
        assert encode_key(a) == encode_key(b)


def test_no_clash_between_kinds_that_print_alike() -> None:
    samples = [5, "5", b"5", (5,), ("5",), ("a:b",), ("a", "b"), "s:a", b"s:a", ("t:",),
               None, "n:", (None,), ("n:",)]
    encoded = [encode_key(k) for k in samples]
    assert len(set(encoded)) == len(samples)
    for a, b in itertools.combinations(samples, 2):
        assert encode_key(a) != encode_key(b)


@pytest.mark.parametrize("bad", [1.5, object(), torch.tensor(1.5), [1, 2]])
def test_refused_keys_say_what_to_do(bad: object) -> None:
    with pytest.raises(ac.KeyEncodingError, match="cache key"):
        encode_key(bad)
    assert issubclass(ac.KeyEncodingError, ac.CacheError)


def test_namespace_rules() -> None:
    assert check_namespace("x") == "x"
    with pytest.raises(ac.ConfigError):
        check_namespace(None)  # type: ignore[arg-type]
    with pytest.raises(ac.ConfigError):
        check_namespace("")
    with pytest.raises(ac.KeyTooLong, match="short name"):
        check_namespace("n" * 300)
    with pytest.raises(ac.ConfigError, match="separates"):
        check_namespace("a:s")  # would make ("a:s", 1) and ("a", "1") one store key


def test_chunk_and_lease_keys_never_collide_with_value_keys() -> None:
    from asynccache.cache.keys import chunk_keys, lease_key

    prefix = namespace_prefix("ns")
    value = prefix + encode_key("x")
    assert chunk_keys(value, "ab12", 2) == [b"ac:ns:c:ab12:0:s:x", b"ac:ns:c:ab12:1:s:x"]
    assert lease_key(value) == b"ac:ns:l:s:x"
    # a user key that spells another kind's key is still a value key of its own
    for tricky in ("x:lease", "c:ab12:0:s:x", "l:s:x", ("c:",)):
        other = prefix + encode_key(tricky)
        assert other not in {lease_key(value), *chunk_keys(value, "ab12", 2)}
    assert lease_key(prefix + encode_key(5)) == b"ac:ns:l:5"
    with pytest.raises(ValueError):
        lease_key(b"not-ours")


def test_a_keyspace_without_a_name_is_unique_and_travels_with_its_pickles() -> None:
    import pickle

    from asynccache.cache.keys import ANON_PREFIX, ANON_TTL, Keyspace

    a, b = Keyspace(None), Keyspace(None)
    assert a.namespace != b.namespace and a.namespace.startswith(ANON_PREFIX)
    assert not a.named and a.key(1) != b.key(1)
    copy = pickle.loads(pickle.dumps(a))
    assert (copy.namespace, copy.named, copy.key(7), copy.key("s")) == (
        a.namespace, False, a.key(7), a.key("s"))
    assert a.ttl(None) == ANON_TTL and a.ttl(5.0) == 5.0  # unnamed: values expire
    named = Keyspace("imagenet-v3")
    assert named.named and named.ttl(None) is None and named.key(3) == b"ac:imagenet-v3:3"
    assert Keyspace("imagenet-v3").key(("a", 1)) == named.key(("a", 1))
    with pytest.raises(ac.KeyTooLong, match="max_key_size"):
        Keyspace("n", max_key_size=10).key("a long key")


def test_an_unnamed_keyspace_says_once_what_it_means(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from asynccache.cache import keys

    keys._announced.clear()
    with caplog.at_level(logging.WARNING, logger="asynccache"):
        keys.Keyspace(None, owner="a pipe")
        keys.Keyspace(None, owner="a pipe")
        keys.Keyspace("named")
    said = [r.getMessage() for r in caplog.records if "namespace=" in r.getMessage()]
    assert len(said) == 1 and "a pipe" in said[0] and "versioned" in said[0]
    assert "DDP ranks" in said[0] and "resumed in a new process" in said[0]
