"""Fork safety, one mechanism for the whole package: the fork generation.

Per-process state (a loop thread, a client's connections, a pipe's runtime) remembers
``_fork.generation`` when it is made; a forked child has a higher one, so a saved value
that differs means "made by an ancestor: do not use it" (a comparison of two ints on the
hot path; ``os.getpid()`` is a system call). The child parks what it inherited here
(`park_inherited()`, never touched nor freed) and builds its own. Locks that another
thread may have held at the fork are replaced through `at_fork()`, the one place
that registers with ``os.register_at_fork``.

Process *identity* is another matter: the owner of a stats board, the holder of a lease
and the files on a board are named by pid, which also tells a spawned process (fresh
interpreter, generation 0) from its parent.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["at_fork", "generation", "park_inherited"]

_parked: list[Any] = []

#: Bumped in every forked child, before any other after-fork callback runs.
generation = 0


def _forked() -> None:
    global generation
    generation += 1


def at_fork(*, before: Callable[[], None] | None = None,
            in_parent: Callable[[], None] | None = None,
            in_child: Callable[[], None] | None = None) -> None:
    """Run ``before`` ahead of every fork and ``in_parent`` / ``in_child`` after it (in the
    child after the generation moved on)."""
    kwargs: dict[str, Callable[[], None]] = {}
    if before is not None:
        kwargs["before"] = before
    if in_parent is not None:
        kwargs["after_in_parent"] = in_parent
    if in_child is not None:
        kwargs["after_in_child"] = in_child
    os.register_at_fork(**kwargs)


at_fork(in_child=_forked)


def park_inherited(obj: Any) -> None:
    """Keep ``obj`` (inherited from the parent process) alive and untouched."""
    if obj is not None:
        _parked.append(obj)
