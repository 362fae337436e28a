"""Ranks of a distributed job: read-ahead that follows ``DistributedSampler.set_epoch``.

A real ``torch.distributed`` job on this machine: 2 ranks (gloo, CPU, loopback), each
with 2 persistent DataLoader workers over one shared store, a ``DistributedSampler``
(``shuffle=True``, a new permutation every epoch through ``set_epoch``) and
``dp.set_order(loader.batch_sampler)``. Epoch 0 is cold (every item computed once, by the
rank whose shard holds it); the later epochs are warm. Measured per rank:

* **served by read-ahead**: the share of warm reads whose value was there before the
  worker asked, from the counters summed over every worker of the job:
  ``prefetch_hits / hits`` (``prefetch_hits`` counts hits only, never a miss read
  ahead);
* **warm epoch** time (median over the warm epochs), with ``set_order`` and without
  (each batch one blocking multi-get per worker);
* **computed in warm epochs**, across ranks (must be 0).

The job itself (`run_job`) is also what ``tests/acceptance/test_distributed.py`` checks.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import asynccache as ac

from ._common import BenchError, Session, markdown_table, progress_bar, session_for

ITEMS = (1536, 768, 384)  # full, quick, smoke
EPOCHS = (5, 4, 3)
BATCH = 16
WORLD = 2
WORKERS = 2
COMPUTE_S = 1e-3


class Logged:
    """Items whose computations are appended to a file every process of the job shares."""

    def __init__(self, n: int, log: str, compute: float = COMPUTE_S) -> None:
        self.n, self.log, self.compute = n, log, compute

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"%d\n" % index)
        finally:
            os.close(fd)
        if self.compute:
            time.sleep(self.compute)
        return {"i": index, "x": torch.full((8,), float(index))}


def computed(log: str) -> list[int]:
    """The indices computed so far, by every process of the job."""
    return [int(x) for x in Path(log).read_text().split()] if os.path.exists(log) else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, job: dict[str, Any]) -> None:
    """One rank: ``job["epochs"]`` epochs, a report in ``{job["out"]}.{rank}``."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(job["port"])
    dist.init_process_group("gloo", rank=rank, world_size=job["world"])
    try:
        dp = ac.AsyncKVCacheMapDataPipe(Logged(job["n"], job["log"], job["compute"]),
                                        ac.connect(job["url"]), namespace=job["namespace"],
                                        lease=job["lease"], prefetch=job["prefetch"])
        shard = (1, 0) if job["same_shard"] else (job["world"], rank)  # (replicas, rank)
        sampler: DistributedSampler[int] = DistributedSampler(
            dp, num_replicas=shard[0], rank=shard[1], shuffle=True, seed=7)
        loader = DataLoader(dp, batch_size=job["batch"], sampler=sampler,
                            num_workers=job["workers"], persistent_workers=True,
                            collate_fn=list, multiprocessing_context="fork")
        if job["follow"] and loader.batch_sampler is not None:
            dp.set_order(loader.batch_sampler)
        report: dict[str, Any] = {"epochs": []}
        for epoch in range(job["epochs"]):
            sampler.set_epoch(epoch)
            dist.barrier()
            before = len(computed(job["log"]))
            expected = list(iter(sampler))
            started = time.perf_counter()
            samples = [s for batch in loader for s in batch]
            seconds = time.perf_counter() - started
            wrong = sum(not torch.equal(s["x"], torch.full((8,), float(s["i"])))
                        for s in samples)
            dist.barrier()  # every rank done: the log holds this epoch's computations
            report["epochs"].append({"expected": expected, "seen": [s["i"] for s in samples],
                                     "wrong": wrong, "seconds": seconds,
                                     "computed": len(computed(job["log"])) - before})
        del loader  # persistent workers exit: their final counters are published
        report["stats"] = dp.stats()
        dp.close()
        Path(f"{job['out']}.{rank}").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def run_job(url: str, namespace: str, work_dir: Path, *, n: int, epochs: int,
            follow: bool = True, lease: float | None = None, compute: float = COMPUTE_S,
            batch: int = BATCH, workers: int = WORKERS, world: int = WORLD,
            prefetch: int = 32, same_shard: bool = False) -> list[dict[str, Any]]:
    """Run the job in ``world`` spawned ranks; each rank's report (see `_rank`).

    ``same_shard``: every rank reads the whole dataset in the same order (as an
    evaluation pass on every rank), so that the ranks miss the same keys at once.
    """
    import torch.multiprocessing as mp

    job = {"url": url, "namespace": namespace, "n": n, "epochs": epochs, "follow": follow,
           "lease": lease, "compute": compute, "batch": batch, "workers": workers,
           "world": world, "prefetch": prefetch, "same_shard": same_shard, "port": free_port(),
           "log": str(work_dir / "computed.log"), "out": str(work_dir / "report")}
    mp.start_processes(_rank, args=(job,), nprocs=world, join=True, start_method="spawn")
    return [json.loads(Path(f"{job['out']}.{rank}").read_text()) for rank in range(world)]


def summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """What the bench reports of one job: read-ahead share, warm epoch time, computations."""
    warm_epochs = [e for r in reports for e in r["epochs"][1:]]
    hits = sum(r["stats"]["hits"] for r in reports)
    prefetch_hits = sum(r["stats"]["prefetch_hits"] for r in reports)  # hits only
    # an epoch of the job lasts as long as its slowest rank
    epoch_s = [max(r["epochs"][e]["seconds"] for r in reports)
               for e in range(1, len(reports[0]["epochs"]))]
    return {"served_by_read_ahead": max(0, prefetch_hits) / hits if hits else 0.0,
            "warm_epoch_s": statistics.median(epoch_s), "warm_epoch_s_all": epoch_s,
            "computed_warm": sum(e["computed"] for e in warm_epochs) // len(reports),
            "computed_cold": reports[0]["epochs"][0]["computed"],
            "wrong": sum(e["wrong"] for r in reports for e in r["epochs"])}


def run(*, quick: bool, out_dir: Path, progress: bool,
        session: Session | None = None) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s:
        store = s.redis_store()
        if store is None:
            return {"skipped": "needs a Redis-protocol store (redis or valkey)"}
        n, epochs = ITEMS[s.mode_index], EPOCHS[s.mode_index]
        results: dict[str, Any] = {
            "config": {"server": store.label, "items": n, "epochs": epochs, "batch": BATCH,
                       "world": WORLD, "workers": WORKERS, "compute_s": COMPUTE_S},
            "cases": {}}
        bar = progress_bar(2, "ranks", s.progress)
        try:
            for follow in (True, False):
                name = "set_order" if follow else "no order"
                with tempfile.TemporaryDirectory(prefix="asynccache-ranks-") as tmp:
                    reports = run_job(store.url, s.namespace("ranks", name.replace(" ", "")),
                                      Path(tmp), n=n, epochs=epochs, follow=follow)
                case = summary(reports)
                if case["wrong"] or case["computed_warm"]:
                    raise BenchError(f"{name}: {case['wrong']} wrong samples, "
                                     f"{case['computed_warm']} computed in warm epochs")
                results["cases"][name] = case
                bar.update()
        finally:
            bar.close()
    return results


def table(results: dict[str, Any]) -> str:
    if "skipped" in results:
        return ""
    c = results["config"]
    rows = [[name, f"{case['served_by_read_ahead']:.0%}", f"{case['warm_epoch_s'] * 1e3:.0f}",
             str(case["computed_cold"]), str(case["computed_warm"])]
            for name, case in results["cases"].items()]
    head = (f"### A distributed job on {c['server']}: {c['world']} ranks (gloo) x "
            f"{c['workers']} persistent workers, DistributedSampler(shuffle=True) + set_epoch, "
            f"{c['items']:,} items, batches of {c['batch']}, {c['epochs']} epochs "
            f"(the first cold)\n")
    return head + markdown_table(["pipe", "warm reads served by read-ahead",
                                  "warm epoch ms (median)", "computed, cold epoch",
                                  "computed, warm epochs"], rows)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    return []
