"""The latency benchmark's reads through a loopback proxy that adds round-trip time.

The store is not local in a real cluster: 0.2 ms is a rack, 1 ms a data centre. This
module puts `asynccache.testing.proxy.FaultProxy` between every client and the store,
``set_latency(rtt)`` for each level, and measures the same read paths and peers as
`asynccache.bench.latency` -- plus ``dp[i]`` at several prefetch depths and a
consumer that does 100 µs of GIL-free work per item (``time.sleep``, as a training step
waiting on the GPU), which is where read-ahead can hide the round trip entirely.

The proxy runs in a child process (its forwarding would otherwise compete for this
process's GIL with the code being measured), on an event loop with a ``select()``
selector and 1 µs timer slack: asyncio's default epoll selector and uvloop round timer
waits to whole milliseconds, which turns a 0.2 ms setting into ~2 ms. Each level's
actual round trip is measured (median of store pings through the proxy) and reported
next to the setting; level 0 is the proxy's own cost.

Coverage: the run's first store with 4 KiB values in a quick run; in a full run that
store with 100 B, 4 KiB and 64 KiB values and every other store with 4 KiB.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from ..cli.progress import Progress
from . import plots
from ._common import (
    BenchError,
    Session,
    Store,
    UvloopRunner,
    case_cells,
    fmt_size,
    fmt_us,
    markdown_table,
    measure,
    progress_bar,
    quiet_gc,
    ratio_cells,
    ratios,
    session_for,
)
from .latency import BATCH, IN_FLIGHT, PREFETCH, Workload, readers

RTTS = ((0.0, 0.2e-3, 1e-3), (0.0, 0.2e-3, 1e-3), (0.0, 1e-3))  # full, quick, smoke
#: value sizes on the run's first store; the other stores (full runs only) get 4 KiB
SIZES = ((100, 4096, 65536), (4096,), (4096,))
OTHER_SIZES = (4096,)
ITEMS = (2_000, 2_000, 256)  # batched and prefetched reads, per repetition
PACED_ITEMS = (800, 600, 64)
SYNC_SECONDS = (0.15, 0.12, 0.02)  # one-round-trip-per-item reads: about this long a rep
DEEP_PREFETCH = 256
WORK_S = 100e-6
PING_SAMPLES = 200


def _work() -> None:
    time.sleep(WORK_S)


# ------------------------------------------------------------------------ proxy process


def _proxy_child_main() -> None:  # pragma: no cover - runs in the child process
    """Serve FaultProxy instances; JSON lines on stdin, one JSON reply line each."""
    import asyncio
    import ctypes
    import selectors

    # FaultProxy makes its loop with asyncio.new_event_loop(): give it select(), whose
    # timeout has microsecond resolution (epoll's has milliseconds).
    asyncio.new_event_loop = lambda: asyncio.SelectorEventLoop(selectors.SelectSelector())
    with contextlib.suppress(Exception):  # Linux: 1 µs timer slack, inherited by threads
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK
    from asynccache.testing.proxy import FaultProxy

    proxies: dict[int, FaultProxy] = {}
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "start":
                proxy = FaultProxy(msg["host"], msg["port"]).start()
                proxies[proxy.port] = proxy
                reply: dict[str, Any] = {"port": proxy.port}
            elif msg["cmd"] == "latency":
                proxies[msg["port"]].set_latency(msg["rtt"])
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown command {msg['cmd']!r}"}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        for proxy in proxies.values():
            proxy.stop()


class ProxyProcess:
    """A child process that runs loopback latency proxies (see the module docstring)."""

    def __init__(self) -> None:
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        code = "from asynccache.bench.network import _proxy_child_main; _proxy_child_main()"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )

    def _ask(self, **msg: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace")[-2000:]
            raise BenchError(f"the proxy process died:\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise BenchError(f"proxy process: {reply['error']}")
        return reply

    def proxy_for(self, store: Store) -> int:
        """Start a proxy to ``store``; returns the port to connect to."""
        return self.proxy_to(store.host, store.port)

    def proxy_to(self, host: str, port: int) -> int:
        """Start a proxy to ``host:port``; returns the port to connect to."""
        return int(self._ask(cmd="start", host=host, port=port)["port"])

    def set_latency(self, port: int, rtt: float) -> None:
        self._ask(cmd="latency", port=port, rtt=rtt)

    def close(self) -> None:
        proc = self._proc
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        self._log.close()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ping_us(store: Store, samples: int = PING_SAMPLES) -> float:
    """Median round trip of a no-op request (PING / version) with a sync client, µs."""
    if store.protocol == "redis":
        import redis

        client: Any = redis.Redis.from_url(store.url)
        op = client.ping
    else:
        from pymemcache.client.base import Client

        client = Client((store.host, store.port), timeout=10, no_delay=True)
        op = client.version
    try:
        op()
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            op()
            times.append(time.perf_counter() - started)
    finally:
        client.close()
    return statistics.median(times) * 1e6


# -------------------------------------------------------------------------------- run


def run(
    *, quick: bool, out_dir: Path, progress: bool, session: Session | None = None
) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc():
        mode = s.mode_index
        stores = list(s.stores.values())
        if s.mode != "full":
            stores = stores[:1]  # the headline store; a full run covers every one
        results: dict[str, Any] = {
            "config": {
                "rtts_s": list(RTTS[mode]),
                "sizes": list(SIZES[mode]),
                "other_store_sizes": list(OTHER_SIZES),
                "items": ITEMS[mode],
                "paced_items": PACED_ITEMS[mode],
                "work_s": WORK_S,
                "batch": BATCH,
                "prefetch": PREFETCH,
                "deep_prefetch": DEEP_PREFETCH,
                "in_flight": IN_FLIGHT,
                "reps": s.reps,
                "warmup": s.warmup,
                "stores": [st.name for st in stores],
                "proxy": "asynccache.testing.proxy.FaultProxy in a child process, select() loop",
                "mode": s.mode,
            },
            "levels": [],
        }
        runner = UvloopRunner()
        bar = progress_bar(0, "network", s.progress)
        try:
            with ProxyProcess() as proxies:
                for store in stores:
                    port = proxies.proxy_for(store)
                    proxied = store.at("127.0.0.1", port)
                    direct_us = ping_us(store)
                    for size in SIZES[mode] if store is stores[0] else OTHER_SIZES:
                        results["levels"] += _levels(
                            s, store, proxied, port, proxies, size, mode, direct_us, runner, bar
                        )
        finally:
            bar.close()
            runner.close()
    return results


def _levels(
    s: Session,
    store: Store,
    proxied: Store,
    port: int,
    proxies: ProxyProcess,
    size: int,
    mode: int,
    direct_us: float,
    runner: UvloopRunner,
    bar: Progress,
) -> list[dict[str, Any]]:
    n = ITEMS[mode]
    n_paced = PACED_ITEMS[mode]
    out = []
    with Workload(s, store, size, n, "net", runner) as w:
        for rtt in RTTS[mode]:
            bar.describe(f"network {store.name} {fmt_size(size)} +{rtt * 1e3:g} ms")
            proxies.set_latency(port, rtt)
            measured_us = ping_us(proxied)
            n_sync = max(16, min(n, int(SYNC_SECONDS[mode] / (measured_us * 1e-6 + 50e-6))))
            with readers(proxied, w, runner) as (ours, peers):
                cases = [
                    ours.item(
                        n_paced,
                        PREFETCH,
                        BATCH,
                        work=_work,
                        name=f"dp[i] p={PREFETCH} + 100 µs work",
                    ),
                    ours.item(n, PREFETCH, BATCH, name=f"dp[i] p={PREFETCH}"),
                    ours.item(n, DEEP_PREFETCH, BATCH, name=f"dp[i] p={DEEP_PREFETCH}"),
                    ours.item(n_sync, 0, BATCH, name="dp[i] p=0"),
                    ours.getitems(n, BATCH, PREFETCH, name=f"__getitems__ p={PREFETCH}"),
                    ours.getitems(n, BATCH, 0, name="__getitems__ p=0"),
                    ours.get_many(n, BATCH, IN_FLIGHT, name="get_many"),
                ]
                if w.peers_ok:
                    cases += [
                        peers.naive(w.plain_keys, n_sync, size, BATCH),
                        peers.floor(w.plain_keys, n, size, BATCH),
                        peers.aiocache(w.plain_keys, n, size, BATCH),
                    ]
                bar.add_total(len(cases) * (s.reps + s.warmup))
                measured = measure(cases, s.reps, s.warmup, bar)
            out.append(
                {
                    "store": store.name,
                    "server": store.label,
                    "value_bytes": size,
                    "rtt_added_s": rtt,
                    "ping_us": measured_us,
                    "ping_direct_us": direct_us,
                    "cases": measured,
                    "ratios": ratios(measured),
                    "note": None if w.peers_ok else "peers skipped: value over the item limit",
                }
            )
    proxies.set_latency(port, 0.0)
    return out


# ------------------------------------------------------------------------------ report


def headline_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per store, size and level: p99 per item of the paths that matter (µs)."""
    rows = []
    for level in results.get("levels", []):
        c = level["cases"]

        def p99(name: str, c: dict[str, Any] = c) -> float | None:
            return c[name]["item_us"]["p99"] if name in c else None

        naive = next((k for k, v in c.items() if v["role"] == "naive"), None)
        rows.append(
            {
                "store": level["store"],
                "value_bytes": level["value_bytes"],
                "rtt_added_ms": level["rtt_added_s"] * 1e3,
                "ping_us": level["ping_us"],
                "p99_dp_prefetch_work_us": p99(f"dp[i] p={PREFETCH} + 100 µs work"),
                "p99_dp_prefetch_us": p99(f"dp[i] p={PREFETCH}"),
                "p99_dp_deep_prefetch_us": p99(f"dp[i] p={DEEP_PREFETCH}"),
                "p99_dp_no_prefetch_us": p99("dp[i] p=0"),
                "p99_naive_us": p99(naive) if naive else None,
                "items_per_s_dp_prefetch": c[f"dp[i] p={PREFETCH}"]["items_per_s"],
                "items_per_s_getitems": c[f"__getitems__ p={PREFETCH}"]["items_per_s"],
                "items_per_s_naive": c[naive]["items_per_s"] if naive else None,
            }
        )
    return rows


def table(results: dict[str, Any]) -> str:
    out = ["### Through a latency proxy (FaultProxy.set_latency)", ""]
    out.append(
        "RTT: the round trip added by the proxy, and the median ping measured through it "
        "(level 0 is the proxy's own cost). Latencies in µs per item at the consumer, median "
        "over repetitions; `+ 100 µs work`: the consumer sleeps 100 µs after each item "
        "(GIL released), the time of `dp[i]` alone is counted."
    )
    out.append("")
    headers = [
        "store / value / RTT / case",
        "items/s",
        "MB/s",
        "p50 item",
        "p95 item",
        "p99 item",
        "p99 batch",
        "CPU µs/item",
        "÷ naive",
        "÷ floor",
        "÷ aiocache",
    ]
    rows = []
    for level in results.get("levels", []):
        label = (
            f"{level['store']} {fmt_size(level['value_bytes'])} "
            f"+{level['rtt_added_s'] * 1e3:g} ms (ping {fmt_us(level['ping_us'])} µs)"
        )
        for name, c in level["cases"].items():
            rows.append(
                [
                    f"{label} · {name}",
                    *case_cells(c, batch=("p99",)),
                    *ratio_cells(level, name, ("naive", "floor", "aiocache")),
                ]
            )
    out.append(markdown_table(headers, rows))
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    levels = results.get("levels", [])
    if not levels:
        return []
    paths = []
    groups = list(dict.fromkeys((lv["store"], lv["value_bytes"]) for lv in levels))
    for metric, ylabel, name in (
        ("p99", "p99 latency per item (µs)", "network_p99_item.png"),
        ("items_per_s", "items/s", "network_items_per_s.png"),
    ):
        panels = []
        for store, size in groups:
            series: dict[str, plots.Series] = {}
            for lv in (x for x in levels if (x["store"], x["value_bytes"]) == (store, size)):
                for case_name, c in lv["cases"].items():
                    y = c["item_us"]["p99"] if metric == "p99" else c["items_per_s"]
                    series.setdefault(case_name, plots.Series(role=c["role"])).add(
                        lv["ping_us"] / 1e3, y
                    )
            panels.append(plots.Panel(f"{store}, {fmt_size(size)}", series))
        paths.append(
            plots.lines(
                out_dir / name,
                panels,
                xlabel="measured round trip through the proxy (ms)",
                ylabel=ylabel,
                title=f"reads through a latency proxy: {ylabel}",
            )
        )
    # CDF at the highest level: what a consumer sees item by item
    top = max(lv["rtt_added_s"] for lv in levels)
    panels = []
    for lv in (x for x in levels if x["rtt_added_s"] == top):
        series = {}
        for case_name, c in lv["cases"].items():
            if c["role"] in ("asynccache", "naive") and "get_many" not in case_name:
                s = series.setdefault(case_name, plots.Series(role=c["role"]))
                for q, v in enumerate(c["item_cdf_us"]):
                    s.add(v, q / 100)
        panels.append(
            plots.Panel(f"{lv['store']}, {fmt_size(lv['value_bytes'])}, +{top * 1e3:g} ms", series)
        )
    paths.append(
        plots.cdf(
            out_dir / "network_cdf.png",
            panels,
            title="per-item latency at the consumer (CDF)",
            xlabel="µs per item",
        )
    )
    return paths
