"""The one lease protocol (`asynccache.cache.leases.lease_protocol`), driven by a script:
the steps it asks for, in order, for each answer the store may give."""

from __future__ import annotations

from typing import Any

from asynccache.cache.leases import Claim, ComputeMine, Leased, WaitFor, lease_protocol


def drive(keys: list[bytes], replies: list[Any]) -> tuple[list[Any], Leased]:
    """The steps asked for and the outcome, each step answered by the next reply."""
    steps = lease_protocol(keys)
    asked = []
    reply: Any = None
    answers = iter(replies)
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as end:
            return asked, end.value
        asked.append(step)
        reply = next(answers)


def test_every_lease_ours_computes_all_and_waits_for_none() -> None:
    asked, out = drive([b"a", b"b"], [({}, [b"a", b"b"], []), {b"a": 1, b"b": 2}])
    assert asked == [Claim([b"a", b"b"]), ComputeMine([b"a", b"b"])]
    assert out == Leased({}, {b"a": 1, b"b": 2})


def test_values_found_on_claim_are_not_computed() -> None:
    asked, out = drive([b"a", b"b"], [({b"a": "x"}, [b"b"], []), {b"b": 2}])
    assert asked == [Claim([b"a", b"b"]), ComputeMine([b"b"])]
    assert out == Leased({b"a": "x"}, {b"b": 2})


def test_ours_are_computed_before_waiting_for_theirs() -> None:
    # what this process holds is written first: the others may be waiting on it
    asked, out = drive([b"a", b"b"], [({}, [b"a"], [b"b"]), {b"a": 1}, ({b"b": "y"}, [])])
    assert asked == [Claim([b"a", b"b"]), ComputeMine([b"a"]), WaitFor([b"b"])]
    assert out == Leased({b"b": "y"}, {b"a": 1})


def test_a_lease_freed_while_waiting_is_computed_here() -> None:
    asked, out = drive([b"a"], [({}, [], [b"a"]), ({}, [b"a"]), {b"a": 3}])
    assert asked == [Claim([b"a"]), WaitFor([b"a"]), ComputeMine([b"a"])]
    assert out == Leased({}, {b"a": 3})


def test_nothing_missing_asks_for_nothing_but_the_claim() -> None:
    asked, out = drive([b"a"], [({b"a": 0}, [], [])])
    assert asked == [Claim([b"a"])]
    assert out == Leased({b"a": 0}, {})
