"""Read-ahead follows every sampler torch ships, by default (issue 38, slice 1).

The loop users write: ``DataLoader(dp, shuffle=True, num_workers=2)`` with no
``generator=``, then ``dp.set_order(loader.batch_sampler)``. A sampler that draws from
torch's global RNG cannot be followed in a worker (each worker's RNG is seeded
differently), so the pipe gives it a generator of its own, seeded from the global RNG:
warm epochs are then served by read-ahead, whatever the sampler, with workers fresh or
persistent, and a run under ``torch.manual_seed`` draws the same orders every time.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import asynccache as ac
from asynccache.bench.workers import OwnRandomSampler

N = 512
BATCH = 16
EPOCHS = 3  # all warm: the first starts the read-ahead, the next two are measured
#: margins fit for a busy CI box: the goal is >= 0.95 served and <= 0.02 wasted; what
#: they guard against is a sampler not followed at all (0.1 served, 0.8 wasted before)
SERVED = 0.8
WASTED = 0.1


class Source(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"i": index, "x": torch.full((8,), float(index))}


def listed(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


def loader_kwargs(kind: str) -> dict[str, Any]:
    """What the user hands DataLoader for each sampler kind (none of them seeded)."""
    if kind == "shuffle":
        return {"shuffle": True}
    if kind == "sequential":
        return {"sampler": SequentialSampler(range(N))}
    if kind == "random-replacement":
        return {"sampler": RandomSampler(range(N), replacement=True, num_samples=N * 3 // 4)}
    if kind == "subset":
        return {"sampler": SubsetRandomSampler(list(range(0, N, 2)))}
    if kind == "weighted":
        return {"sampler": WeightedRandomSampler([1.0 + i % 3 for i in range(N)], N,
                                                 replacement=True)}
    if kind == "batch-drop-last":
        return {"batch_sampler": BatchSampler(RandomSampler(range(N)), BATCH - 3,
                                              drop_last=True)}
    raise AssertionError(kind)


KINDS = ["shuffle", "sequential", "random-replacement", "subset", "weighted",
         "batch-drop-last"]
WORKERS = [pytest.param(0, False, id="0 workers"), pytest.param(2, False, id="2 fresh"),
           pytest.param(2, True, id="2 persistent")]


def make_loader(dp: Any, kind: str, workers: int, persistent: bool) -> DataLoader:
    kwargs = loader_kwargs(kind)
    if "batch_sampler" not in kwargs:
        kwargs["batch_size"] = BATCH
    return DataLoader(dp, num_workers=workers, persistent_workers=persistent,
                      collate_fn=listed, **kwargs)


def settled(dp: Any, want: int) -> dict[str, int]:
    """Stats once every read is in (workers report about every second)."""
    deadline = time.monotonic() + 10
    while True:
        stats = dp.stats()
        reads = stats["hits"] + stats["misses"] + stats["recalled"]
        if reads >= want or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def run_epochs(dp: Any, loader: DataLoader) -> list[dict[str, int]]:
    """Each epoch's reads checked; the stats after each."""
    after, reads = [], 0
    for _ in range(EPOCHS):
        for batch in loader:
            for value in batch:
                assert torch.equal(value["x"], torch.full((8,), float(value["i"])))
            reads += len(batch)
        after.append(settled(dp, reads))
    return after


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize(("workers", "persistent"), WORKERS)
@pytest.mark.parametrize("kind", KINDS)
def test_warm_epochs_are_served_by_read_ahead(redis_server: Any, namespace: str, kind: str,
                                              workers: int, persistent: bool) -> None:
    with ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url),
                                    namespace=namespace) as warm_up:
        warm_up.__getitems__(list(range(N)))  # every epoch warm: samplers with replacement
    dp = ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url), prefetch=64,
                                    namespace=namespace)
    try:
        loader = make_loader(dp, kind, workers, persistent)
        dp.set_order(loader.batch_sampler)
        stats = run_epochs(dp, loader)
    finally:
        dp.close()
    first, last = stats[0], stats[-1]  # the first epoch starts the read-ahead up

    def delta(name: str) -> int:
        return last[name] - first[name]

    reads = delta("hits") + delta("misses") + delta("recalled")
    assert reads > 0 and delta("misses") == 0, last  # warm: nothing computed
    served = delta("prefetch_hits") / reads
    wasted = delta("prefetch_wasted") / reads
    assert served >= SERVED and wasted <= WASTED, (served, wasted, last)
    assert last["readahead_stopped"] == 0, last  # a followed order never stops guessing


def test_a_sampler_without_a_generator_gets_one_and_the_run_is_reproducible(
        redis_server: Any, namespace: str) -> None:
    """The pipe seeds the sampler's generator from torch's global RNG: under
    ``torch.manual_seed`` two runs read the same orders."""
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        dp = ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url),
                                        namespace=namespace)
        loader = DataLoader(dp, batch_size=BATCH, shuffle=True, collate_fn=listed)
        sampler: Any = loader.sampler
        assert sampler.generator is None
        dp.set_order(loader.batch_sampler)
        assert isinstance(sampler.generator, torch.Generator)
        runs.append([[v["i"] for batch in loader for v in batch] for _ in range(2)])
        dp.close()
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # still a new permutation every epoch
    assert sorted(runs[0][0]) == list(range(N))


def test_a_seeded_generator_is_left_as_it_is(redis_server: Any, namespace: str) -> None:
    generator = torch.Generator().manual_seed(5)
    loader = DataLoader(Source(), batch_size=BATCH, shuffle=True, generator=generator)
    with ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url),
                                    namespace=namespace) as dp:
        dp.set_order(loader.batch_sampler)
    sampler: Any = loader.sampler
    assert sampler.generator is generator


class Bigger(Source):
    def __len__(self) -> int:
        return 4 * N


@pytest.mark.parametrize(("workers", "persistent"), WORKERS)
def test_an_order_that_cannot_be_followed_stops_the_guessing(
        redis_server: Any, namespace: str, workers: int, persistent: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    """The issue's case at a quarter of its size: 2,048 items, batches of 64."""
    n, batch = 4 * N, 64
    with ac.AsyncKVCacheMapDataPipe(Bigger(), ac.connect(redis_server.url),
                                    namespace=namespace) as warm_up:
        warm_up.__getitems__(list(range(n)))
    dp = ac.AsyncKVCacheMapDataPipe(Bigger(), ac.connect(redis_server.url), prefetch=64,
                                    namespace=namespace)
    try:
        loader = DataLoader(dp, batch_size=batch, sampler=OwnRandomSampler(n), num_workers=workers,
                            persistent_workers=persistent, collate_fn=listed)
        dp.set_order(loader.batch_sampler)
        with caplog.at_level(logging.WARNING, logger="asynccache"):
            stats = run_epochs(dp, loader)
    finally:
        dp.close()
    last = stats[-1]
    reads = last["hits"] + last["misses"] + last["recalled"]
    assert reads == EPOCHS * n and last["misses"] == 0, last
    # found within a batch of each worker's first epoch (fresh workers: of every epoch):
    # keys read ahead in vain stay a few percent of the reads (0.8 per read before)
    assert last["prefetch_wasted"] <= 0.05 * reads, last
    assert last["readahead_stopped"] >= 1, last
    if workers == 0:  # workers log in their own processes: once per job, by the board
        said = [r for r in caplog.records if "read-ahead stopped guessing" in r.message]
        assert len(said) == 1 and "set_order(indices)" in said[0].message


def test_read_ahead_resumes_when_the_reads_follow_the_order_again(
        redis_server: Any, namespace: str) -> None:
    with ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url),
                                    namespace=namespace) as warm_up:
        warm_up.__getitems__(list(range(N)))
    order = list(range(N))
    random.Random(3).shuffle(order)
    with ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url), prefetch=64,
                                    namespace=namespace, order=order) as dp:
        for index in random.Random(4).sample(range(N), N // 4):  # not the order given
            assert dp[index]["i"] == index
        stopped = dp.stats()
        assert stopped["readahead_stopped"] == 1, stopped
        for index in order:  # ... then the reads come in the order given
            assert dp[index]["i"] == index
        after = dp.stats()
    assert after["readahead_stopped"] == 1
    served = after["prefetch_hits"] - stopped["prefetch_hits"]
    assert served >= 0.8 * N, after


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("persistent", [False, True])
def test_stateful_dataloader_is_followed_and_resumes(redis_server: Any, namespace: str,
                                                     persistent: bool) -> None:
    """torchdata's StatefulDataLoader(shuffle=True), no generator given: followed, and a
    loader resumed from a mid-epoch state_dict reads the same remaining batches."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    with ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url),
                                    namespace=namespace) as warm_up:
        warm_up.__getitems__(list(range(N)))

    def make() -> tuple[Any, StatefulDataLoader]:
        dp = ac.AsyncKVCacheMapDataPipe(Source(), ac.connect(redis_server.url), prefetch=64,
                                        namespace=namespace)
        loader = StatefulDataLoader(dp, batch_size=BATCH, shuffle=True, num_workers=2,
                                    persistent_workers=persistent, collate_fn=listed)
        dp.set_order(loader.batch_sampler)
        return dp, loader

    dp, loader = make()
    other, resumed = make()
    try:
        stats = run_epochs(dp, loader)
        served = (stats[-1]["prefetch_hits"] - stats[0]["prefetch_hits"]) / ((EPOCHS - 1) * N)
        assert served >= SERVED, stats[-1]
        batches = iter(loader)
        for _ in range(5):
            next(batches)
        state = loader.state_dict()
        rest = [[v["i"] for v in batch] for batch in batches]
        resumed.load_state_dict(state)
        assert [[v["i"] for v in batch] for batch in resumed] == rest
    finally:
        dp.close()
        other.close()
