"""The decorator's call keys (docs/formats.md, "Call keys"): exact over types, stable,
hashed when long, and a function's identity that never confuses two functions."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import functools
import math
import uuid
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import asynccache as ac
from asynccache.cache.decorator import CallKey, function_identity
from asynccache.cache.keys import CALL_KEY_RAW_MAX, Keyspace, call_store_key, encode_arg


def canonical(value: Any) -> Any:
    """What an argument means to the call-key encoding: its type and its value, so True,
    1 and 1.0 differ; -0.0 and 0.0 differ; every NaN is one NaN (docs/formats.md)."""
    kind = type(value)
    if kind is float:
        return ("float", "nan" if math.isnan(value) else repr(value))
    if kind in (bytes, bytearray):
        return ("bytes", bytes(value))
    if kind in (tuple, list):
        return (kind.__name__, tuple(canonical(v) for v in value))
    if kind is dict:
        return ("dict", tuple(sorted(((canonical(k), canonical(v)) for k, v in value.items()),
                                     key=repr)))
    if kind in (set, frozenset):
        return ("set", tuple(sorted((canonical(v) for v in value), key=repr)))
    return (kind.__name__, value)


hashables = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                      st.binary(max_size=8))
atoms = st.one_of(hashables, st.binary(max_size=4).map(bytearray))
arguments = st.recursive(
    atoms,
    lambda inner: (st.tuples(inner) | st.tuples(inner, inner) | st.lists(inner, max_size=3)
                   | st.dictionaries(hashables, inner, max_size=3)
                   | st.frozensets(hashables, max_size=3) | st.sets(hashables, max_size=3)),
    max_leaves=8)


@given(arguments, arguments)
def test_distinct_arguments_never_share_a_key_and_equal_ones_do(a: Any, b: Any) -> None:
    assert (encode_arg(a) == encode_arg(b)) is (canonical(a) == canonical(b))


@given(st.dictionaries(hashables, arguments, max_size=5))
def test_a_dicts_order_of_insertion_does_not_matter(d: dict[Any, Any]) -> None:
    assert encode_arg(dict(reversed(list(d.items())))) == encode_arg(d)


def test_the_seven_keys_of_the_issue_are_seven() -> None:
    seven = [True, 1, 1.0, "1", b"1", (1,), [1]]
    assert len({encode_arg(v) for v in seven}) == 7


class Colour(str, enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    ONE = 1


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: float
    label: str = dataclasses.field(default="", compare=False)


class Pair(NamedTuple):
    a: int
    b: str


def test_types_that_equal_their_value_still_have_keys_of_their_own() -> None:
    assert encode_arg(Colour.RED) != encode_arg("red")
    assert encode_arg(Level.ONE) != encode_arg(1)
    assert encode_arg(np.int64(5)) != encode_arg(5)
    assert encode_arg(np.float64(0.5)) != encode_arg(0.5)
    assert encode_arg(Pair(1, "a")) != encode_arg((1, "a"))


def test_documented_choices_for_floats_and_decimals() -> None:
    assert encode_arg(-0.0) != encode_arg(0.0)  # two values (1/x tells them apart)
    assert encode_arg(float("nan")) == encode_arg(-float("nan"))  # one NaN
    assert encode_arg(decimal.Decimal("1.0")) == encode_arg(decimal.Decimal("1.00"))
    long = decimal.Decimal("1." + "0" * 40 + "1")  # no rounding to the context's precision
    assert encode_arg(long) != encode_arg(decimal.Decimal(1))


def test_dates_uuids_decimals_dataclasses_and_namedtuples_are_accepted() -> None:
    values = [datetime.datetime(2024, 5, 1, 12, 0), datetime.date(2024, 5, 1),
              datetime.time(12, 0), datetime.timedelta(days=1), uuid.UUID(int=7),
              decimal.Decimal("2.5"), Point(1, 2.0), Pair(1, "a"), Colour.RED, 1 + 2j, int]
    encoded = [encode_arg(v) for v in values]
    assert len(set(encoded)) == len(values)
    assert encode_arg(Point(1, 2.0, "a")) == encode_arg(Point(1, 2.0, "b"))  # compare=False
    assert encode_arg(Point(1, 2.0)) != encode_arg(Point(1, 3.0))


def test_anything_else_is_refused_naming_key_and_cache_key() -> None:
    with pytest.raises(ac.KeyEncodingError, match=r"key=.*__cache_key__"):
        encode_arg(object(), "argument x=")

    class Tenant:
        def __init__(self, name: str) -> None:
            self.name = name

        def __cache_key__(self) -> str:
            return self.name

    assert encode_arg(Tenant("a")) == encode_arg(Tenant("a")) != encode_arg(Tenant("b"))


def test_a_long_call_is_hashed_never_refused() -> None:
    space = Keyspace("svc-v1")
    short = call_store_key(space, encode_arg("x"))
    assert short == b"ac:svc-v1:f1:s1:x"
    long = call_store_key(space, encode_arg("x" * 5000))
    assert long.startswith(b"ac:svc-v1:f1:#") and len(long) <= CALL_KEY_RAW_MAX
    assert call_store_key(space, encode_arg("x" * 5001)) != long
    tight = Keyspace("svc-v1", max_key_size=60)
    assert len(call_store_key(tight, encode_arg("y" * 100))) <= 60


def _identity(fn: Any, noself: bool = False) -> bytes:
    return function_identity(fn, noself)


def test_functions_that_share_a_qualified_name_never_share_an_identity() -> None:
    def power(n: int) -> Any:
        def f(x: int) -> int:
            return int(x**n)
        return f

    square, cube = power(2), power(3)
    assert square.__qualname__ == cube.__qualname__
    assert _identity(square) != _identity(cube)
    assert _identity(power(2)) == _identity(square)  # the same in every process
    lambdas = [lambda x: x * x, lambda x: x**3]  # one line, two bodies
    assert _identity(lambdas[0]) != _identity(lambdas[1])


def test_partials_and_callable_instances_have_identities() -> None:
    def scale(x: int, by: int) -> int:
        return x * by

    assert _identity(functools.partial(scale, by=2)) != _identity(functools.partial(scale, by=3))

    class Model:
        def __init__(self, version: str) -> None:
            self.version = version

        def __call__(self, x: int) -> int:
            return x

        def __cache_key__(self) -> str:
            return self.version

    assert _identity(Model("a")) != _identity(Model("b"))

    class Anonymous:
        def __call__(self, x: int) -> int:
            return x

    with pytest.raises(ac.MethodKeyError, match=r"__cache_key__.*noself=True"):
        _identity(Anonymous())
    assert _identity(Anonymous(), noself=True) == _identity(Anonymous(), noself=True)


def test_methods_join_their_instance_or_say_how() -> None:
    cache = ac.AsyncKVCache(ac.connect("memory://call-keys"), namespace="svc-v1")

    class Repo:
        def __init__(self, tenant: str) -> None:
            self.tenant = tenant

        def __cache_key__(self) -> str:
            return self.tenant

        def name(self, i: int) -> str:
            return f"{self.tenant}-{i}"

    class Plain:
        def name(self, i: int) -> str:
            return str(i)

        @classmethod
        def make(cls, i: int) -> str:
            return str(i)

    class Sub(Plain):
        pass

    key = CallKey(cache, Repo.name, None, noself=False)
    assert key((Repo("a"), 1), {}) != key((Repo("b"), 1), {})
    assert key((Repo("a"), 1), {}) == key((Repo("a"),), {"i": 1})
    with pytest.raises(ac.MethodKeyError, match=r"__cache_key__.*noself=True"):
        CallKey(cache, Plain.name, None, noself=False)((Plain(), 1), {})
    shared = CallKey(cache, Plain.name, None, noself=True)
    assert shared((Plain(), 1), {}) == shared((Plain(), 1), {})
    assert shared((Plain(), 1), {}) != shared((Sub(), 1), {})  # a subclass may override
    make = CallKey(cache, Plain.make.__func__, None, noself=False)  # type: ignore[attr-defined]
    assert make((Plain, 1), {}) != make((Sub, 1), {})
