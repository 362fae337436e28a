"""One ``asynccache warm`` worker: fill the store with its share of a dataset's items.

Why it is built this way: docs/design.md, "A warm worker".
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..cache.codec import MAX_MANIFEST_BLOB, Codec
from ..cache.core import AsyncKVCache
from ..cache.keys import chunk_keys
from ..cache.markers import MISSING, Failed
from ..errors import ConfigError, EncodeError, StoreError
from ..store.api import BaseClient
from ..store.connect import connect
from ..store.tiered import Tiered

__all__ = ["WarmJob", "cap_threads", "indices_of", "load_dataset", "run_share"]

#: computed, skipped, failed: a worker's slots in the shared progress array
COMPUTED, SKIPPED, FAILED = 0, 1, 2
SLOTS = 3
#: item failures a worker prints before it only counts them
MAX_REPORTED = 3


@dataclass(frozen=True)
class WarmJob:
    """Everything a worker needs, picklable (spawn/forkserver workers get it by pickle)."""

    url: str
    dataset: str
    namespace: str
    ttl: float | None
    secret_env: str | None
    workers: int
    batch: int
    timeout: float | None
    verify: bool = False
    #: ``--near``: fill ``Tiered(connect(near), connect(url))``
    near: str | None = None


def load_dataset(spec: str) -> Any:
    """The dataset named by ``module:attr`` (``attr`` may be dotted). ``attr`` is either a
    map-style dataset, or a callable (a function, a class) that returns one when called
    with no arguments. Raises ConfigError saying what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--dataset {spec!r} is not module:attr (e.g. mypkg.data:train_set)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules in the current directory
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--dataset {spec}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"--dataset {spec}: {module_name} has no attribute "
                              f"{attr!r}") from None
    if isinstance(obj, type) or (callable(obj) and not _map_style(obj)):
        obj = obj()
    if not _map_style(obj):
        raise ConfigError(f"--dataset {spec} is a {type(obj).__name__}, not a map-style dataset "
                          "(it needs __getitem__ and __len__), nor a callable returning one")
    return obj


def _map_style(obj: Any) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def indices_of(dataset: Any) -> Sequence[Any]:
    """What a pipe over ``dataset`` is indexed by: a mapping's keys, else 0..len-1."""
    from ..readahead.order import mapping_behind

    mapping = mapping_behind(dataset)
    return list(mapping.keys()) if mapping is not None else range(len(dataset))


def cap_threads(workers: int) -> None:
    """Give each of ``workers`` processes its share of the cores for torch's own threads
    (unless the user chose, with ``OMP_NUM_THREADS``): N workers each running torch ops on
    every core make N times more threads than cores, and each item slower than alone."""
    torch = sys.modules.get("torch")
    if torch is None or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // workers))


def run_share(job: WarmJob, worker: int, progress: Any, messages: Any) -> None:
    """Process entry point: the items ``worker::workers`` of the dataset. Counts go to
    ``progress`` (a shared array), messages to ``messages`` (a queue the parent writes
    out above its progress bar). Exits with 1 when the store failed (the rest of the
    share is then counted as failed)."""
    try:
        dataset = load_dataset(job.dataset)
        cap_threads(job.workers)
        share = indices_of(dataset)[worker::job.workers]
        ok = asyncio.run(_Share(job, dataset, progress, worker * SLOTS, messages).fill(share))
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0 if ok else 1)


class _Share:
    def __init__(self, job: WarmJob, dataset: Any, progress: Any, slot: int,
                 messages: Any) -> None:
        seconds = job.timeout  # None: the URL's, else the default
        self.client: BaseClient[Any] = connect(job.url, timeout=seconds,
                                               connect_timeout=seconds)
        if job.near is not None:
            self.client = Tiered(connect(job.near, timeout=seconds, connect_timeout=seconds),
                                 self.client)
        codec = Codec.from_env(job.secret_env) if job.secret_env else None
        self.cache = AsyncKVCache(self.client, job.namespace, job.ttl, codec, on_error="raise")
        self.dataset = dataset
        self.batch = job.batch
        self.verify = job.verify
        self.progress = progress
        self.slot = slot
        self.messages = messages
        self.reported = 0

    def count(self, which: int, n: int) -> None:
        if n:
            self.progress[self.slot + which] += n  # only this worker writes its slots

    def complain(self, message: str) -> None:
        self.reported += 1
        if self.reported <= MAX_REPORTED:
            self.messages.put(message)

    async def fill(self, share: Sequence[Any]) -> bool:
        """Check, compute, write, a batch at a time: a batch is computed (in a thread: the
        event loop stays free, so no store timeout ever spans a computation) while the
        previous one is written. Every item gets one outcome, counted here, on the loop's
        thread: skipped, computed (its write succeeded) or failed."""
        writing: asyncio.Task[None] | None = None
        try:
            for start in range(0, len(share), self.batch):
                indices = share[start:start + self.batch]
                keys = [self.cache.key(index) for index in indices]
                present = await self.present(keys)
                todo = [(i, k) for i, k in zip(indices, keys) if k not in present]
                self.count(SKIPPED, len(keys) - len(todo))
                entries, items, errors = await asyncio.to_thread(self.compute, todo)
                self.count(FAILED, len(errors))
                for message in errors:
                    self.complain(message)
                if writing is not None:
                    await writing
                writing = asyncio.ensure_future(self.write(entries, items))
            if writing is not None:
                await writing
        except StoreError as exc:
            if writing is not None:  # its outcome no longer matters, only its counts
                await asyncio.gather(writing, return_exceptions=True)
            self.complain(f"the store failed, this worker stops: {exc}")
            accounted = sum(self.progress[self.slot:self.slot + SLOTS])
            self.count(FAILED, len(share) - accounted)  # the rest, computed or not
            return False
        finally:
            await self.client.close()
        return True

    async def present(self, keys: list[bytes]) -> set[bytes]:
        """Of ``keys``, those to skip: the store holds a value for them, found without
        transferring it (docs/design.md, "A warm worker"); with ``verify``, values a pipe would
        read as a hit."""
        if self.verify:
            return await self.readable(keys)
        if self.client.max_value_size is None:  # never chunked: a key there is a value
            return {k for k, there in zip(keys, await self.client.contains_many(keys))
                    if there}
        sizes = await self.client.sizes_many(keys)
        large = {k for k, size in zip(keys, sizes)
                 if size is not None and size > MAX_MANIFEST_BLOB}
        small = [k for k, size in zip(keys, sizes)
                 if size is not None and size <= MAX_MANIFEST_BLOB]  # perhaps a manifest
        return large | await self.readable(small)

    async def readable(self, keys: list[bytes]) -> set[bytes]:
        """Of ``keys``, those a pipe would read as a hit: read and decoded. A key may be
        only a chunk manifest: one whose chunks are gone (evicted apart from it, or
        refused when it was written) is read as a miss, so it must be written again,
        not skipped. Manifests are checked further by their chunks' existence (no
        chunk transferred); a value the codec does not accept is a miss too."""
        if not keys:
            return set()
        blobs = await self.client.get_many(keys)
        values, manifests, _nbytes, _largest = self.cache.reads.decode(keys, blobs)
        found = {key for key, value in zip(keys, values)
                 if value is not MISSING and type(value) is not Failed}
        if manifests:
            plan = {keys[i]: chunk_keys(keys[i], m.token, m.chunks)
                    for i, m in manifests.items()}
            flat = [k for chunk_list in plan.values() for k in chunk_list]
            there = dict(zip(flat, await self.client.contains_many(flat)))
            found.update(key for key, chunk_list in plan.items()
                         if all(there[k] for k in chunk_list))
        return found

    def compute(self, todo: list[tuple[Any, bytes]]
                ) -> tuple[dict[bytes, bytes], int, list[str]]:
        """Encoded entries for the missing items, how many items they hold, and a message
        per item that raised (the caller counts those failed). Runs in a thread."""
        entries: dict[bytes, bytes] = {}
        items = 0
        errors: list[str] = []
        for index, key in todo:
            try:
                entries.update(self.cache.writer.encode_entries({key: self.dataset[index]}))
            except EncodeError as exc:
                errors.append(f"item {index!r} cannot be stored: {exc}")
                continue
            except Exception as exc:  # the user's __getitem__: report it, go on
                errors.append(f"item {index!r} failed: {type(exc).__name__}: {exc}")
                continue
            items += 1
        return entries, items, errors

    async def write(self, entries: dict[bytes, bytes], items: int) -> None:
        if not entries:
            return
        try:
            await self.cache.write_entries(entries)
        except StoreError:
            self.count(FAILED, items)
            raise
        self.count(COMPUTED, items)
