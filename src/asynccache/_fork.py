"""What a forked child inherits from its parent and must never touch, nor free.

After ``fork`` the child holds copies of the parent's event loop, transports and
connection pools. Using them would share sockets with the parent; letting them be
garbage-collected would run their finalizers (uvloop's and asyncio's "unclosed
transport" handlers, pending-task warnings) on objects that belong to another
process. So the child parks them here for the rest of its life and builds fresh ones.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["generation", "park_inherited"]

_parked: list[Any] = []

#: Bumped in every forked child: comparing a saved value with it is the per-item
#: "did we fork?" check (``os.getpid()`` is a system call).
generation = 0


def _forked() -> None:
    global generation
    generation += 1


os.register_at_fork(after_in_child=_forked)


def park_inherited(obj: Any) -> None:
    """Keep ``obj`` (inherited from the parent process) alive and untouched."""
    if obj is not None:
        _parked.append(obj)
