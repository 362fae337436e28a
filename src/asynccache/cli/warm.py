"""``asynccache warm URL --dataset module:attr --namespace NS``: fill a store ahead of
training, so that the first epoch is already a warm one.

The dataset is named, not pickled: ``module:attr`` where ``attr`` is a map-style dataset
(``__getitem__`` and ``__len__``) or a callable returning one (a function or a class,
called with no arguments). The current directory is importable, as with ``python -m``.
Each of ``--workers`` processes imports it and takes a disjoint share (indices
``w, w + N, w + 2N, ...``), so the CPU work spreads over cores; see
`asynccache.cli.warm_share` for what a worker does and why its values are exactly
what ``AsyncKVCacheMapDataPipe(dataset, client, namespace=NS)`` reads.

Resumable: keys already in the store are skipped without being computed, so an
interrupted run (Ctrl-C, a crash, an expired TTL) is finished by running it again. The
check transfers no values (a few bytes per key: ``EXISTS``/``STRLEN``, memcached
``mg``), so resuming over a 140 GB namespace does not download it; ``--verify`` reads
and decodes them instead.
Progress goes to stderr (tqdm when installed, else a counter; `asynccache.cli.progress`);
never with ``--json``. Workers do not print: they send their messages to this process,
which writes them above the bar, each on a line of its own.
``--near NEAR_URL`` fills ``Tiered(near, URL)``: both tiers; a key either holds is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from typing import Any

from ..cache.codec import Codec
from ..cache.keys import namespace_prefix
from ..errors import StoreError
from ._common import (
    EXIT_OK,
    add_common_options,
    add_near_option,
    client_for,
    emit,
    failed,
    guarded,
    namespace_arg,
    positive_float,
    positive_int,
    store_url,
)
from .progress import Progress
from .warm_share import (
    COMPUTED,
    FAILED,
    SKIPPED,
    SLOTS,
    WarmJob,
    indices_of,
    load_dataset,
    run_share,
)

__all__ = ["add_arguments", "run"]

EXIT_INTERRUPTED = 130
#: seconds between two looks at the workers' counters
POLL = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Fill a store from a map-style dataset, in parallel processes, "
                          "with the keys and encoding AsyncKVCacheMapDataPipe(dataset, "
                          "client, namespace=NS) reads. Keys already there are skipped, so "
                          "running it again resumes. Exit code 1 if the store is "
                          "unreachable or items failed.")
    parser.add_argument("url", metavar="URL", type=store_url, help="store URL")
    parser.add_argument("--dataset", "-d", required=True, metavar="MODULE:ATTR",
                        help="the dataset: a map-style object, or a callable (function or "
                        "class) returning one when called without arguments")
    parser.add_argument("--namespace", "-n", required=True, type=namespace_arg,
                        help="the namespace the pipe will use (namespace=NS)")
    parser.add_argument("--workers", "-w", type=positive_int, default=1,
                        help="processes computing items (default 1)")
    parser.add_argument("--ttl", type=positive_float, default=None, metavar="SECONDS",
                        help="expiry of the values written (default: none), as the pipe's ttl=")
    parser.add_argument("--secret-env", metavar="NAME", default=None,
                        help="sign values with the secret(s) in this environment variable, "
                        "as Codec.from_env(NAME): for pipes built with that codec")
    parser.add_argument("--batch", type=positive_int, default=256,
                        help="items per existence check and write (default 256)")
    parser.add_argument("--verify", action="store_true",
                        help="read and decode every value already there before skipping it "
                        "(downloads them; default: sizes only, no value transferred)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_near_option(parser)
    add_common_options(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    if args.secret_env:
        Codec.from_env(args.secret_env)  # unset or empty: a usage error now, not N times
    dataset = load_dataset(args.dataset)
    total = len(indices_of(dataset))
    del dataset  # each worker loads its own
    client = client_for(args)
    url = client.safe_url
    try:
        asyncio.run(_reachable(client))
    except StoreError as exc:
        return failed(args, f"cannot reach {url}: {exc}", url=url, namespace=args.namespace)
    job = WarmJob(args.url, args.dataset, args.namespace, args.ttl, args.secret_env,
                  args.workers, args.batch, args.timeout, args.verify, args.near)
    started = time.perf_counter()
    outcome = _run_workers(job, total, show=not (args.json or args.no_progress))
    seconds = time.perf_counter() - started
    document: dict[str, Any] = {
        "url": url, "namespace": args.namespace,
        "prefix": namespace_prefix(args.namespace).decode(),
        "items": total, **outcome.counts, "workers": args.workers, "seconds": round(seconds, 3),
        "items_per_second": round(total / seconds, 1) if seconds > 0 else None,
    }
    if outcome.interrupted:
        print(f"asynccache warm: interrupted: {_summary(document)}; run it again to resume",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if outcome.counts["failed"] or outcome.worker_failed:
        return failed(args, f"{outcome.counts['failed']:,} of {total:,} items were not stored "
                      f"({_summary(document)})", **document)
    emit(args, document, f"warmed {document['prefix']} on {url}: {_summary(document)}")
    return EXIT_OK


async def _reachable(client: Any) -> None:
    try:
        await client.ping()
    finally:
        await client.close()


def _summary(doc: dict[str, Any]) -> str:
    return (f"{doc['items']:,} items in {doc['seconds']:.1f} s ({doc['computed']:,} computed, "
            f"{doc['skipped']:,} skipped, {doc['failed']:,} failed; {doc['workers']} "
            f"worker{'s' if doc['workers'] != 1 else ''})")


class _Outcome:
    def __init__(self, counts: dict[str, int], worker_failed: bool, interrupted: bool) -> None:
        self.counts = counts
        self.worker_failed = worker_failed
        self.interrupted = interrupted


def _run_workers(job: WarmJob, total: int, *, show: bool) -> _Outcome:
    """Start the workers, show their progress and messages until all exited, sum their
    counts."""
    ctx = multiprocessing.get_context()
    progress = ctx.Array("q", SLOTS * job.workers, lock=False)
    messages = ctx.SimpleQueue()
    workers = [ctx.Process(target=run_share, args=(job, w, progress, messages),
                           name=f"asynccache-warm-{w}") for w in range(job.workers)]
    interrupted = False
    with Progress(total, "warm", unit="item", enabled=show) as bar:
        done = 0

        def look() -> None:
            nonlocal done
            while not messages.empty():
                bar.write(f"asynccache warm: {messages.get()}", file=sys.stderr)
            now = sum(progress)
            bar.update(now - done)
            done = now

        try:
            for worker in workers:
                worker.start()
            while any(worker.is_alive() for worker in workers):
                look()
                time.sleep(POLL)
        except KeyboardInterrupt:  # the workers got the same SIGINT: wait for them to stop
            interrupted = True
            for worker in workers:
                worker.join(5)
                if worker.is_alive():
                    worker.terminate()
        for worker in workers:
            worker.join()
        look()
    messages.close()
    counts = {name: sum(progress[w * SLOTS + slot] for w in range(job.workers))
              for name, slot in (("computed", COMPUTED), ("skipped", SKIPPED),
                                 ("failed", FAILED))}
    worker_failed = any(worker.exitcode not in (0, None) for worker in workers)
    return _Outcome(counts, worker_failed and not interrupted, interrupted)
