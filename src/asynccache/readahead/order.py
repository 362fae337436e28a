"""The order a pipe's reads will come in, as a plan: one epoch of an order (a list, array,
tensor or sampler), drawn without changing the user's sampler or torch's random state, and
the keyed mapping behind a dataset, if any."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["as_list", "mapping_behind", "one_pass", "worker_info"]

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
    state = torch.get_rng_state()  # a sampler without a generator draws from it
    try:
        return as_list(_detached(order, torch))
    finally:
        torch.set_rng_state(state)


def _detached(order: Any, torch: Any) -> Any:
    """A shallow copy of a sampler (and of the sampler it wraps) with cloned generators."""
    generator = getattr(order, "generator", None)
    inner = getattr(order, "sampler", None)
    if not isinstance(generator, torch.Generator) and inner is None:
        return order
    clone = copy.copy(order)
    if isinstance(generator, torch.Generator):
        twin = torch.Generator(device=generator.device)
        twin.set_state(generator.get_state())
        clone.generator = twin
    if inner is not None and inner is not order:
        clone.sampler = _detached(inner, torch)
    return clone
