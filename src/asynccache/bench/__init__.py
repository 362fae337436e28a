"""``asynccache bench``: asynccache against its peers, measured in one run.

Each benchmark module has the same three functions, so `asynccache.bench.cli`
just loops over the selected ones::

    run(*, quick: bool, out_dir: pathlib.Path, progress: bool) -> dict   # JSON-able
    table(results: dict) -> str                                          # markdown
    plot(results: dict, out_dir: pathlib.Path) -> list[pathlib.Path]     # PNG files

Our modules also take ``session=`` (the stores, machine description and sizes shared by
one CLI run); without it they start their own private servers.

Modules: ``goals`` (the goals of large values and scale-out, one ratio each: large
values against per-key GET and the loopback limit, small values against the MGET loop,
memcached against aiomcache and emcache, a 3-node cluster against one node, cold and
warm DataLoader epochs against no cache), ``core`` (``AsyncKVCache.get_many`` against a
hand-written ``redis.asyncio`` MGET loop, layer by layer), ``datapipe`` (the pipe's read
paths against the same floor, a naive client and a dict), ``latency`` (the three read
paths by value size, batch size and prefetch depth on Redis, Valkey and memcached, with
six peers in the same run), ``network`` (the same through a loopback proxy that adds
round-trip latency), ``distance`` (the read-ahead over a store 0.5–5 ms away: rate ÷ the
same proxy at +0, the window it settled on, 4 KiB and 1 MiB values) and ``dataloader``
(DataLoader memory, sharing and epoch time; written separately) and ``workers`` (warm
shuffled epochs with 2 and 4 workers, with and without read-ahead that follows the
sampler, at loopback and +1 ms; the node against the pipe and a plain Mapper) and
``local`` (one machine, no network: LMDB against Redis on a unix socket, warm, through a
DataLoader with 2 workers and ``dp[i]`` in process, at 4 KiB and 256 KiB), ``services``
(an aiohttp service on ``AsyncKVCache.get_or_compute`` against the same service on
aiocache and on plain ``redis.asyncio``, under ``wrk -c64``: req/s, p50, p99,
computations in a stampede on one cold key; and the cost of ``import asynccache``) and
``ranks`` (a distributed job, 2 ranks x 2 persistent workers with a
``DistributedSampler``: the share of warm reads served by read-ahead that follows
``set_epoch``) and ``tiered`` (``Tiered(lmdb, redis)`` against the far Redis alone
behind the latency proxy at +0.2 ms and +1 ms: warm epochs from near, a first epoch
copying into near).

Method, everywhere: values are written once, then read warm. Every case gets warm-up
runs, then the cases of one comparison are timed round-robin (A B C A B C ...) so that
drift on a shared machine hits all of them alike; every figure is the median over the
timed repetitions; every ratio compares two cases of the same run, on the same server
and the same values. Latency is taken at the consumer with ``time.perf_counter`` around
each ``dp[i]`` and each awaited or returned batch. Nothing is asserted on timings.
"""

from __future__ import annotations

__all__ = ["MODULES"]

#: benchmark modules in the order a full run goes through them
MODULES = ("goals", "core", "datapipe", "latency", "network", "distance", "dataloader",
           "workers", "local", "services", "ranks", "tiered")
