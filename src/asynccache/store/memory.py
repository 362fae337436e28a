"""An in-process store with the client interface: for unit tests of the core only.

Named stores are shared within one process (``memory://name``); nothing crosses a
process boundary, so it is not a substitute for a real store with DataLoader workers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence

from .api import SimpleStore

__all__ = ["MemoryClient"]

_STORES: dict[str, dict[bytes, tuple[bytes, float | None]]] = {}


class MemoryClient(SimpleStore[None]):
    """A dict behind the async client interface, with TTLs and an optional size limit."""

    scheme = "memory"
    process_local = True

    def __init__(self, *, name: str = "default", max_value_size: int | None = None,
                 **options: object) -> None:
        """Which in-process dict, and its limit.

        Args:
            name: clients with the same name in one process share one dict.
            max_value_size: the largest value in one item (``None``: no limit; larger
                values are chunked).
            **options: `BaseClient`'s: ``timeout``, ``connect_timeout``, ``max_batch``.
        """
        super().__init__(**options)  # type: ignore[arg-type]
        self.name = name
        self.max_value_size = max_value_size
        self.calls: dict[str, int] = {"get_many": 0, "set_many": 0, "delete_many": 0}

    @property
    def safe_url(self) -> str:
        return f"memory://{self.name}"

    @property
    def data(self) -> dict[bytes, tuple[bytes, float | None]]:
        return _STORES.setdefault(self.name, {})

    def _open_state(self) -> None:
        return None

    async def _close_state(self, state: None) -> None:
        return None

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self.calls["get_many"] += 1
        now = time.monotonic()
        data = self.data
        out: list[bytes | None] = []
        for key in keys:
            entry = data.get(key)
            if entry is not None and entry[1] is not None and entry[1] <= now:
                del data[key]
                entry = None
            out.append(None if entry is None else entry[0])
        return out

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        self.calls["set_many"] += 1
        expires = None if ttl is None else time.monotonic() + ttl
        self.data.update((k, (bytes(v), expires)) for k, v in mapping.items())

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        self.calls["delete_many"] += 1
        for key in keys:
            self.data.pop(key, None)

    async def ping(self) -> None:
        return None

    def clear(self) -> None:
        self.data.clear()

    async def add_many(self, entries: Mapping[bytes, bytes], ttl: float) -> list[bool]:
        now = time.monotonic()
        data = self.data
        added = []
        for key, value in entries.items():
            entry = data.get(key)
            if entry is not None and (entry[1] is None or entry[1] > now):
                added.append(False)
                continue
            data[key] = (bytes(value), now + ttl)
            added.append(True)
        return added

    async def scan(self, prefix: bytes, batch: int = 1000
                   ) -> AsyncIterator[list[tuple[bytes, int | None]]]:
        now = time.monotonic()
        found: list[tuple[bytes, int | None]] = [
            (key, len(value)) for key, (value, expires) in list(self.data.items())
            if key.startswith(prefix) and (expires is None or expires > now)]
        for start in range(0, len(found), max(1, batch)):
            yield found[start:start + batch]

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        now = time.monotonic()
        data = self.data
        return [(entry := data.get(key)) is not None and (entry[1] is None or entry[1] > now)
                for key in keys]
