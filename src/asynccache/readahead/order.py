"""The order a pipe's reads will come in, as a plan: one epoch of an order (a list, array,
tensor or sampler), drawn without changing the user's sampler or torch's random state, and
the keyed mapping behind a dataset, if any."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

__all__ = ["EpochDraws", "Start", "as_list", "mapping_behind", "one_pass", "seed_generators",
           "worker_info"]

#: How far from its guess a worker looks for the epoch a first read belongs to.
EPOCH_SEARCH = 8

#: Attributes through which a datapipe chain or wrapper reaches what it wraps.
_WRAPPED = ("datapipe", "sequence", "dataset", "source")


def mapping_behind(source: Any) -> Mapping[Any, Any] | None:
    """The mapping a source (or the datapipe chain it ends) is keyed by, if any."""
    node, seen = source, 0
    while node is not None and seen < 16:
        if isinstance(node, Mapping):
            return node
        node = next((getattr(node, a) for a in _WRAPPED if hasattr(node, a)), None)
        seen += 1
    return None


def as_list(order: Iterable[Any]) -> list[Any]:
    """An order's items as a list: arrays and tensors through ``tolist()`` (plain ints)."""
    tolist = getattr(order, "tolist", None)
    items = tolist() if callable(tolist) else list(order)
    return items if isinstance(items, list) else [items]


def worker_info() -> Any:
    """torch's DataLoader worker info in a worker process, else None."""
    get = getattr(sys.modules.get("torch.utils.data"), "get_worker_info", None)
    return get() if get is not None else None


def one_pass(order: Iterable[Any]) -> list[Any]:
    """One epoch of ``order``.

    In a DataLoader worker the worker's own copy of the order is iterated: the worker was
    made (forked, or unpickled) from the parent's state just before the parent draws the
    epoch's permutation from the same generator, so both draw the same one, epoch after
    epoch (with persistent workers too). Anywhere else a *detached* copy is iterated, so
    that asking for the plan never advances the user's sampler or torch's global random
    state: the cache must not change the training order.
    """
    if worker_info() is not None:
        return as_list(order)
    torch = sys.modules.get("torch")
    if torch is None:
        return as_list(order)
    return _drawn(_detached(order, torch), torch)


def _drawn(copy_: Any, torch: Any) -> list[Any]:
    """One epoch of a copy this process iterates, torch's global random state left as it
    was (a sampler without a generator draws from it)."""
    state = torch.get_rng_state()
    try:
        return as_list(copy_)
    finally:
        torch.set_rng_state(state)


def _chain(order: Any) -> Iterator[Any]:
    """``order`` and the samplers it wraps (``.sampler``: a batch sampler's), a few deep."""
    node, seen = order, 0
    while node is not None and seen < 4:
        yield node
        inner = getattr(node, "sampler", None)
        node, seen = (inner if inner is not node else None), seen + 1


def _detached(order: Any, torch: Any) -> Any:
    """A shallow copy of a sampler (and of the sampler it wraps) with cloned generators."""
    generator = getattr(order, "generator", None)
    inner = getattr(order, "sampler", None)
    if not isinstance(generator, torch.Generator) and inner is None:
        if isinstance(order, torch.Tensor) or not hasattr(order, "__dict__"):
            return order
        # a sampler with state of its own (StatefulDistributedSampler counts what it
        # yielded, for a checkpoint): iterated as a copy, the user's count is left alone
        try:
            return copy.copy(order)
        except Exception:  # an object that refuses to be copied: read as before
            return order
    clone = copy.copy(order)
    if isinstance(generator, torch.Generator):
        twin = torch.Generator(device=generator.device)
        twin.set_state(generator.get_state())
        clone.generator = twin
    if inner is not None and inner is not order:
        clone.sampler = _detached(inner, torch)
    return clone


def seed_generators(order: Any) -> int:
    """Give each torch sampler in ``order`` (and in the samplers it wraps) that draws from
    torch's global RNG a generator of its own, seeded from that RNG now; how many.

    A sampler without a generator (``DataLoader(shuffle=True)`` with no ``generator=``,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``) draws each epoch from the global
    RNG of the process that iterates it, and every DataLoader worker's global RNG is
    seeded differently: a worker's copy of the sampler can never draw the permutation
    the main process draws, and read-ahead would only ever guess wrong. With a generator
    of its own the sampler draws the same permutations in the main process and in each
    worker's copy (made from the same generator state), epoch after epoch. Seeded from
    the global RNG, so a run under ``torch.manual_seed`` still draws the same orders every
    time (not the same as without the pipe: one draw is taken here, and the sampler no
    longer moves the global RNG). Only in the process that owns the order, and only
    torch's samplers (a ``generator`` attribute that is None).
    """
    torch = sys.modules.get("torch")
    if torch is None or worker_info() is not None:
        return 0
    sampler_type = getattr(getattr(torch, "utils", None), "data", None)
    sampler_type = getattr(sampler_type, "Sampler", None)
    seeded = 0
    for node in _chain(order):
        if (sampler_type is not None and isinstance(node, sampler_type)
                and hasattr(node, "generator") and node.generator is None):
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            node.generator = torch.Generator().manual_seed(seed)
            seeded += 1
    return seeded


class Start:
    """An order as it was when it was given (``set_order``), in the process that owns it:
    a detached copy of the sampler, its generators cloned.

    Why: with no DataLoader workers the loader iterates the user's sampler in this
    process, and it has already drawn the epoch's permutation from the generator when
    the pipe's first read asks for a plan: a detached copy made then would draw the
    *next* epoch's. A copy made when the order was given, iterated once per epoch,
    draws what the loader draws, epoch after epoch, as a worker's own copy does. Only
    for orders whose randomness is a generator's state (not a sampler told its epoch,
    ``set_epoch``, whose current state is what to draw from).
    """

    def __init__(self, copy_: Any) -> None:
        self.copy = copy_

    @classmethod
    def of(cls, order: Any) -> Start | None:
        torch = sys.modules.get("torch")
        if (order is None or torch is None or worker_info() is not None
                or epoch_sampler(order) is not None
                or not any(isinstance(getattr(node, "generator", None), torch.Generator)
                           for node in _chain(order))):
            return None
        return cls(_detached(order, torch))

    def draws(self) -> Any:
        """A copy of its own for one consumer (each iterates it once per epoch)."""
        return _detached(self.copy, sys.modules["torch"])


def epoch_sampler(order: Any) -> Any:
    """The sampler inside ``order`` whose permutation is a function of an epoch it is told
    (``set_epoch(e)`` and an integer ``epoch``, as ``DistributedSampler``), if any."""
    return next((node for node in _chain(order) if callable(getattr(node, "set_epoch", None))
                 and type(getattr(node, "epoch", None)) is int), None)


class EpochDraws:
    """One consumer's epochs of an order, one after another.

    In the process that owns the order, each draw iterates a detached copy of the user's
    sampler as it is now (``one_pass``), which follows whatever the training loop did to
    it. A DataLoader worker iterates its *own copy*, made when the worker started: a
    persistent worker's copy of a ``DistributedSampler`` never sees the ``set_epoch(e)``
    the training loop calls on the parent's. So in a worker each draw after the first
    moves the copy on one epoch (the common loop: ``set_epoch(epoch)`` every epoch), and
    when the first read of an epoch shows the guess wrong (the loop skipped or repeated
    an epoch, or does not call ``set_epoch``), `find()` looks for the epoch that read
    belongs to, around the guess. The user's sampler is never touched.
    """

    def __init__(self, order: Iterable[Any], start: Start | None = None) -> None:
        self.order = order
        self.draws = 0
        self.last: list[Any] | None = None
        #: outside workers, an order with a generator: a copy of it as it was given,
        #: iterated once per epoch in step with the loader (see `Start`)
        self.own = start.draws() if start is not None and worker_info() is None else None

    def _worker_sampler(self) -> Any:
        return epoch_sampler(self.order) if worker_info() is not None else None

    def next(self) -> list[Any]:
        """The next epoch, as a guess."""
        sampler = self._worker_sampler()
        if sampler is not None and self.draws:
            sampler.set_epoch(sampler.epoch + 1)
        self.draws += 1
        self.last = (one_pass(self.order) if self.own is None
                     else _drawn(self.own, sys.modules["torch"]))
        return self.last

    def find(self, fits: Callable[[list[Any]], bool]) -> list[Any]:
        """The epoch that ``fits`` what was read (else this process's current one)."""
        sampler = self._worker_sampler()
        if sampler is None and self.last is not None and worker_info() is not None:
            # a worker's own copy, not told an epoch (a generator): drawn once per epoch,
            # in step with the parent's; drawing it again would move it on for good
            return self.last
        if self.own is not None and self.last is not None and fits(self.last):
            return self.last  # the own copy's draw, in step with the loader (`Start`)
        items = one_pass(self.order)
        if sampler is None or fits(items):
            return items
        guess = sampler.epoch
        for step in range(1, EPOCH_SEARCH + 1):
            for epoch in (guess - step, guess + step):  # a repeated epoch before a skipped one
                if epoch < 0:
                    continue
                sampler.set_epoch(epoch)
                found = one_pass(self.order)
                if fits(found):
                    return found
        sampler.set_epoch(guess)
        return items
