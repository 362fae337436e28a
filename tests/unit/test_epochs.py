"""Following an order across epochs in a DataLoader worker, with no I/O: ``EpochDraws``
against a sampler whose permutation is a function of the epoch it is told."""

from __future__ import annotations

import random
from typing import Any

import pytest

from asynccache.readahead import order as orders


class TellSampler:
    """A sampler whose permutation is a function of ``seed + epoch`` (as DistributedSampler)."""

    def __init__(self, n: int, seed: int = 7) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        perm = list(range(self.n))
        random.Random(self.seed + self.epoch).shuffle(perm)
        return iter(perm)

    def __len__(self) -> int:
        return self.n


class Batches:
    """A batch sampler over a sampler (as torch's BatchSampler)."""

    def __init__(self, sampler: TellSampler, size: int) -> None:
        self.sampler, self.size = sampler, size

    def __iter__(self) -> Any:
        items = list(self.sampler)
        return iter([items[i:i + self.size] for i in range(0, len(items), self.size)])


@pytest.fixture
def in_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(orders, "worker_info", lambda: object())


def test_the_sampler_told_its_epoch_is_found_inside_a_batch_sampler() -> None:
    sampler = TellSampler(10)
    assert orders.epoch_sampler(Batches(sampler, 4)) is sampler
    assert orders.epoch_sampler(list(range(10))) is None


def test_a_worker_moves_its_copy_on_one_epoch_per_draw(in_a_worker: None) -> None:
    parent = TellSampler(30)
    copy = TellSampler(30)  # what a persistent worker holds: made at epoch 0, never told
    draws = orders.EpochDraws(copy)
    for epoch in range(4):
        parent.set_epoch(epoch)
        assert draws.next() == list(parent)


def test_a_worker_finds_a_skipped_or_repeated_epoch_from_its_first_read(
        in_a_worker: None) -> None:
    parent, copy = TellSampler(30), TellSampler(30)
    draws = orders.EpochDraws(copy)
    draws.next()
    for epoch in (1, 1, 5, 2):  # repeated, skipped ahead, back
        parent.set_epoch(epoch)
        actual = list(parent)
        guess = draws.next()
        assert guess != actual or epoch == copy.epoch
        assert draws.find(lambda items, a=actual: items[0] == a[0]) == actual
        assert copy.epoch == epoch


def test_outside_a_worker_the_users_sampler_is_read_as_it_is_and_never_moved() -> None:
    sampler = TellSampler(20)
    draws = orders.EpochDraws(sampler)
    assert draws.next() == list(sampler)
    sampler.set_epoch(3)
    assert draws.next() == list(sampler)
    assert draws.find(lambda items: False) == list(sampler)
    assert sampler.epoch == 3


def test_nothing_found_keeps_the_guess(in_a_worker: None) -> None:
    copy = TellSampler(30)
    draws = orders.EpochDraws(copy)
    draws.next()
    guess = draws.next()
    assert draws.find(lambda items: False) == guess and copy.epoch == 1


def test_a_workers_generator_sampler_is_drawn_once_per_epoch(in_a_worker: None) -> None:
    """A persistent worker's copy of a sampler with a generator (no set_epoch) stays in
    step with the parent's only if it is drawn once per epoch: a first read that is not
    the guess's first index (a resumed loader, a peek) must not draw it again."""
    import copy

    import torch
    from torch.utils.data import RandomSampler

    parent = RandomSampler(range(20), generator=torch.Generator().manual_seed(1))
    draws = orders.EpochDraws(copy.deepcopy(parent))
    assert draws.next() == list(parent)
    draws.find(lambda items: False)  # the first read was another index
    assert draws.next() == list(parent)  # the parent's next epoch, still in step
