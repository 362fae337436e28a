"""``AsyncKVCacheMapDataPipe`` warm reads against the hand-written floor and a naive client.

(Formerly ``bench/bench_datapipe.py``.) On the run's first Redis-protocol store
(127.0.0.1 TCP), 20,000 items of 100 bytes, first written through the pipe itself
(misses computed, written behind, ``flush()``), then read warm:

(a) ``dp[i]`` for i in 0..n-1, ``prefetch=64``: items/s, as a ratio to the hand-written
    ``redis.asyncio`` MGET loop (64 keys, 4 in flight, uvloop, pickle.loads) reading the
    same 20,000 values, and to a naive synchronous ``redis.Redis.get`` + ``pickle.loads``
    per item.
(b) the same consumer doing ~100 us of GIL-free work per item; total time as a ratio to
    the same loop over a dict of the decoded values. Two kinds of work:
    ``time.sleep(100e-6)`` (the consumer blocks with the GIL released and its core idle,
    as a training step waiting on a GPU does; Linux timer slack stretches it to ~150+ us,
    so the dict loop with the same work is the reference, nothing is assumed) and
    ``numpy.sin`` over a float64 array sized to ~100 us (GIL released, core busy: CPU-bound
    augmentation in C; it competes with the loop thread and the server for the cores).
(c) ``__getitems__`` with batches of 64 indices, items/s.

Diagnostics (full runs, public API only): ``for v in dp`` (the plan is known up front),
``dp[i]`` with ``prefetch=256``, and ``__getitems__`` after ``set_order(range(n))``.

Finally (full runs) the (a) path is profiled: with py-spy when it is installed (samples
every thread, native sampling, idle time excluded), else pyinstrument in the consumer
and the loop thread. Top entries per thread are reported and stored in the JSON; the
raw py-spy samples go to the output directory.
"""

from __future__ import annotations

import collections
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import redis

import asynccache as ac
from asynccache.store.loop import get_loop_thread

from ..cli.progress import Progress
from . import plots
from ._common import (
    BenchError,
    Session,
    Timing,
    UvloopRunner,
    batches_of,
    bench_redis_async,
    bench_redis_sync,
    cpu_ratio,
    fail_if_incomplete,
    fmt_rate,
    markdown_table,
    pickled,
    progress_bar,
    quiet_gc,
    ratio,
    run_interleaved,
    session_for,
)
from .peers import delete_keys, hand_written_mget, naive_sync_get, write_plain

N_ITEMS = (20_000, 10_000, 1_000)  # full, quick, smoke
NAIVE_ITEMS = (4_000, 2_000, 300)
WORK_ITEMS = (10_000, 1_000, 200)
PROFILE_SECONDS = (8.0, 0.0, 0.0)
VALUE_BYTES = 100
PREFETCH = 64
BATCH = 64
IN_FLIGHT = 4
WORK_S = 100e-6


# --------------------------------------------------------------------------- consumers


def read_sequential(dp: Any, n: int) -> int:
    count = 0
    for i in range(n):
        if dp[i] is not None:
            count += 1
    return count


def read_iter(dp: Any) -> int:
    count = 0
    for v in dp:
        if v is not None:
            count += 1
    return count


def read_batches(dp: Any, batches: Sequence[list[int]]) -> int:
    count = 0
    for batch in batches:
        count += len(dp.__getitems__(batch))
    return count


def consume_with_work(store: Any, n: int, work: Callable[[], Any]) -> int:
    """The training loop of (b): one item, then the work; ``store`` is a dict or the pipe."""
    count = 0
    for i in range(n):
        if store[i] is not None:
            count += 1
        work()
    return count


class NumpyWork:
    """``np.sin`` over a float64 array sized so one call takes about ``target_s``.

    numpy releases the GIL inside the ufunc loop (arrays over a few hundred elements),
    and ``sin`` is compute-bound, so this is steady, GIL-free CPU work.
    """

    def __init__(self, target_s: float) -> None:
        probe = 8192
        a = np.random.default_rng(0).random(probe)
        out = np.empty_like(a)
        samples = []
        for _ in range(7):
            started = time.thread_time()
            for _ in range(200):
                np.sin(a, out=out)
            samples.append((time.thread_time() - started) / 200)
        per_element = statistics.median(samples) / probe
        self.size = max(1024, int(target_s / per_element))
        self.a = np.random.default_rng(1).random(self.size)
        self.out = np.empty_like(self.a)

    def __call__(self) -> None:
        np.sin(self.a, out=self.out)


def sleep_work() -> None:
    time.sleep(WORK_S)


# --------------------------------------------------------------------------- setup


def populate(dp: Any, n: int) -> dict[str, int]:
    """Write every item through the pipe: misses computed, written behind, flushed."""
    for batch in batches_of(list(range(n)), 256):
        dp.__getitems__(list(batch))
    dp.flush()
    return dp.stats()


def verify(dp: Any, source: Sequence[bytes]) -> None:
    """One warm pass that checks every value (not timed): a wrong value is a bug, stop."""
    before = dp.stats()["computed"]
    for i in range(len(source)):
        if dp[i] != source[i]:
            raise BenchError(f"dp[{i}] differs from source[{i}]: the benchmark would measure a bug")
    if dp.stats()["computed"] != before:
        raise BenchError("warm pass computed items: the store did not hold every value")


def thread_cpu_times() -> tuple[float, float]:
    """CPU seconds used so far by this (consumer) thread and by asynccache's loop thread.

    Per-thread CPU time is steady when other processes compete for the cores (wall time
    is not) and says which side of the hand-off costs what.
    """
    consumer = time.thread_time()
    ident = get_loop_thread().thread.ident
    loop = time.clock_gettime(time.pthread_getcpuclockid(ident)) if ident else 0.0
    return consumer, loop


def stats_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = (
        "hits",
        "misses",
        "errors",
        "computed",
        "prefetch_hits",
        "stalls",
        "stall_us",
        "direct_reads",
        "prefetch_wasted",
        "stall_timeouts",
        "batches",
    )
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


# --------------------------------------------------------------------------- profiling


def find_pyspy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def profile_sequential(dp: Any, n: int, seconds: float, out_dir: Path) -> dict[str, Any]:
    pyspy = find_pyspy()
    if pyspy is not None:
        try:
            return _profile_pyspy(pyspy, dp, n, seconds, out_dir)
        except (OSError, RuntimeError) as exc:
            print(f"py-spy failed ({exc}); falling back to pyinstrument", file=sys.stderr)
    return _profile_pyinstrument(dp, n, seconds, out_dir)


def _profile_pyspy(pyspy: str, dp: Any, n: int, seconds: float, out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"profile-datapipe-{time.strftime('%Y%m%d-%H%M%S')}.pyspy.txt"
    rate = 500
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            # --nonblocking: py-spy's default stops the process for each sample, and a
            # ptrace stop lands at the next return to user space, which over-counts frames
            # that make syscalls (os.getpid, socket writes) by several times here.
            [
                pyspy,
                "record",
                "--pid",
                str(os.getpid()),
                "--threads",
                "--nolineno",
                "--nonblocking",
                "--format",
                "raw",
                "--rate",
                str(rate),
                "--duration",
                str(int(seconds)),
                "--output",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        time.sleep(1.0)  # attach
        passes = 0
        started = time.perf_counter()
        while proc.poll() is None and time.perf_counter() - started < seconds + 30:
            read_sequential(dp, n)
            passes += 1
        elapsed = time.perf_counter() - started
        proc.wait(timeout=30)
        err.seek(0)
        message = err.read().decode(errors="replace")
    if proc.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy exit {proc.returncode}: {message.strip()[-300:]}")
    threads = _parse_collapsed(raw.read_text(encoding="utf-8"))
    return {
        "tool": "py-spy",
        "rate_hz": rate,
        "seconds": seconds,
        "passes": passes,
        "workload_s": elapsed,
        "raw_file": str(raw),
        "threads": threads,
        "note": "py-spy --nonblocking, idle samples dropped; a thread blocked in C "
        "(epoll, GIL) shows as its last Python frame",
    }


def _parse_collapsed(text: str) -> dict[str, Any]:
    """py-spy raw output -> per thread: samples, top self (leaf) and top inclusive frames."""
    per: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        head, _, frames_text = stack.partition(";")
        name = head.split(":", 1)[1].strip() if ":" in head else head
        if name.startswith("asynccache-loop"):
            name = "loop thread"
        elif name == "MainThread":
            name = "consumer thread"
        if not frames_text:  # a thread sampled with no Python frame on its stack
            continue
        frames = frames_text.split(";")
        count = int(count_text)
        entry = per.setdefault(
            name, {"samples": 0, "self": collections.Counter(), "inclusive": collections.Counter()}
        )
        entry["samples"] += count
        entry["self"][frames[-1]] += count
        for frame in set(frames):
            entry["inclusive"][frame] += count
    out: dict[str, Any] = {}
    for name, e in per.items():
        total = e["samples"]
        out[name] = {
            "samples": total,
            "top_self": [(f, c / total) for f, c in e["self"].most_common(15)],
            "top_inclusive": [
                (f, c / total) for f, c in e["inclusive"].most_common(40) if not _is_boilerplate(f)
            ][:15],
        }
    return out


def _is_boilerplate(frame: str) -> bool:
    return frame.startswith(
        (
            "Thread.",
            "<module>",
            "_run_module",
            "_run_code",
            "main ",
            "_profile_",
            "profile_sequential",
            "run (",
            "LoopThread._run",
        )
    )


def _profile_pyinstrument(dp: Any, n: int, seconds: float, out_dir: Path) -> dict[str, Any]:
    """Fallback: pyinstrument in both threads. Caveat: time the loop thread spends idle in
    epoll is charged to the first Python call after it, so read its numbers as upper bounds.
    """
    from pyinstrument import Profiler

    loop = get_loop_thread()
    consumer = Profiler(interval=0.0005, async_mode="disabled")
    in_loop = Profiler(interval=0.0005, async_mode="disabled")

    def on_loop(fn: Callable[[], Any]) -> None:
        done = threading.Event()
        def call() -> None:
            fn()
            done.set()

        loop.call_soon(call)
        done.wait(10)

    on_loop(in_loop.start)
    consumer.start()
    passes = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        read_sequential(dp, n)
        passes += 1
    consumer.stop()
    on_loop(in_loop.stop)
    threads = {}
    for name, prof in (("consumer thread", consumer), ("loop thread", in_loop)):
        root = prof.last_session.root_frame() if prof.last_session else None
        if root is None:
            continue
        selfs: collections.Counter[str] = collections.Counter()
        incl: collections.Counter[str] = collections.Counter()
        _walk_pyinstrument(root, selfs, incl, ())
        total = root.time or 1.0
        threads[name] = {
            "samples": None,
            "top_self": [(f, t / total) for f, t in selfs.most_common(15)],
            "top_inclusive": [
                (f, t / total) for f, t in incl.most_common(40) if not _is_boilerplate(f)
            ][:15],
        }
    return {
        "tool": "pyinstrument",
        "seconds": seconds,
        "passes": passes,
        "workload_s": time.perf_counter() - started,
        "threads": threads,
        "note": "pyinstrument: loop-thread idle time is charged to the next call",
    }


def _walk_pyinstrument(
    frame: Any,
    selfs: collections.Counter[str],
    incl: collections.Counter[str],
    seen: tuple[str, ...],
) -> None:
    if frame.is_synthetic:
        return
    label = f"{frame.function} ({frame.file_path_short})"
    selfs[label] += frame.total_self_time
    if label not in seen:
        incl[label] += frame.time
    for child in frame.children:
        _walk_pyinstrument(child, selfs, incl, (*seen, label))


# --------------------------------------------------------------------------- run


def run(
    *, quick: bool, out_dir: Path, progress: bool, session: Session | None = None
) -> dict[str, Any]:
    with session_for(session, quick=quick, progress=progress) as s, quiet_gc():
        store = s.redis_store()
        if store is None:
            return {"skipped": "needs a Redis-protocol store (redis or valkey)"}
        mode = s.mode_index
        return _run(s, store, mode, Path(out_dir))


def _run(s: Session, store: Any, mode: int, out_dir: Path) -> dict[str, Any]:
    n = N_ITEMS[mode]
    n_naive = min(n, NAIVE_ITEMS[mode])
    n_work = min(n, WORK_ITEMS[mode])
    rng = np.random.default_rng(42)
    source = [rng.bytes(VALUE_BYTES) for _ in range(n)]
    namespace = s.namespace("dp")
    results: dict[str, Any] = {
        "config": {
            "store": store.name,
            "server": store.label,
            "items": n,
            "value_bytes": VALUE_BYTES,
            "prefetch": PREFETCH,
            "batch": BATCH,
            "in_flight": IN_FLIGHT,
            "reps": s.reps,
            "mode": s.mode,
            "naive_items": n_naive,
            "work_items": n_work,
        },
    }
    client = ac.connect(store.url)
    ttl = s.ttl(store)
    dp = ac.AsyncKVCacheMapDataPipe(source, client, prefetch=PREFETCH, namespace=namespace, ttl=ttl)
    hw_keys = [f"{s.namespace('dp-hw')}:{i}".encode() for i in range(n)]
    bar = progress_bar(0, "datapipe", s.progress)
    pipes = [dp]
    runner = UvloopRunner()
    hw = bench_redis_async(store)
    sync_r = bench_redis_sync(store)
    try:
        results["populate_stats"] = populate(dp, n)
        verify(dp, source)
        write_plain(store, [k.decode() for k in hw_keys], pickled(source), ttl)
        hw_batches = batches_of(hw_keys, BATCH)
        idx_batches = [list(b) for b in batches_of(list(range(n)), BATCH)]
        dp256 = ac.AsyncKVCacheMapDataPipe(
            source, client, prefetch=256, namespace=namespace, ttl=ttl
        )
        dp_order = ac.AsyncKVCacheMapDataPipe(
            source, client, prefetch=PREFETCH, namespace=namespace, ttl=ttl
        )
        pipes += [dp256, dp_order]
        results["a_c"] = _run_throughput(
            dp,
            dp256,
            dp_order,
            runner,
            hw,
            hw_batches,
            sync_r,
            hw_keys[:n_naive],
            idx_batches,
            n,
            s.reps,
            s.warmup,
            diagnostics=s.mode == "full",
            bar=bar,
        )
        results["b"] = _run_with_work(dp, source, n_work, s.reps, bar)
        if PROFILE_SECONDS[mode]:
            bar.describe("datapipe profile")
            results["profile"] = profile_sequential(dp, n, PROFILE_SECONDS[mode], out_dir)
        results["pipe_stats_total"] = dp.stats()
    finally:
        bar.close()
        runner.run(hw.aclose())
        runner.close()
        sync_r.close()
        for pipe in pipes:
            pipe.close()
        delete_keys(store, [*hw_keys, *(dp.key_for(i) for i in range(n))])
    return results


def _run_throughput(
    dp: Any,
    dp256: Any,
    dp_order: Any,
    runner: UvloopRunner,
    hw: Any,
    hw_batches: Sequence[Sequence[bytes]],
    sync_r: redis.Redis,
    naive_keys: Sequence[bytes],
    idx_batches: Sequence[list[int]],
    n: int,
    reps: int,
    warmup: int,
    diagnostics: bool,
    bar: Progress,
) -> dict[str, Any]:
    def checked(name: str, expected: int, fn: Callable[[], int]) -> Callable[[], None]:
        def case() -> None:
            fail_if_incomplete(name, fn(), expected)

        return case

    def ordered_batches() -> int:
        dp_order.set_order(range(n))  # a new epoch: tell the prefetcher what comes next
        return read_batches(dp_order, idx_batches)

    cases = {
        "(a) dp[i] sequential, prefetch=64": checked("dp[i]", n, lambda: read_sequential(dp, n)),
        "hand-written MGET 64x4 (uvloop)": checked(
            "hand-written", n, lambda: runner.run(hand_written_mget(hw, hw_batches, IN_FLIGHT))
        ),
        "naive sync GET + pickle.loads": checked(
            "naive", len(naive_keys), lambda: naive_sync_get(sync_r, naive_keys)
        ),
        "(c) __getitems__ x64": checked("getitems", n, lambda: read_batches(dp, idx_batches)),
    }
    if diagnostics:  # public knobs that show where the time goes (full run only)
        cases["  for v in dp (plan known)"] = checked("iter", n, lambda: read_iter(dp))
        cases["  dp[i] sequential, prefetch=256"] = checked(
            "dp256", n, lambda: read_sequential(dp256, n)
        )
        cases["  __getitems__ x64 after set_order"] = checked("ordered", n, ordered_batches)
    timings = {
        name: Timing(name, len(naive_keys) if name.startswith("naive") else n, VALUE_BYTES)
        for name in cases
    }
    stats: dict[str, dict[str, int]] = {}
    pipes = {
        "(a) dp[i] sequential, prefetch=64": dp,
        "(c) __getitems__ x64": dp,
        "  for v in dp (plan known)": dp,
        "  dp[i] sequential, prefetch=256": dp256,
        "  __getitems__ x64 after set_order": dp_order,
    }

    def with_stats(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        pipe = pipes.get(name)
        if pipe is None:
            return fn

        def case() -> None:
            before = pipe.stats()
            cpu_before = thread_cpu_times()
            fn()
            cpu_after = thread_cpu_times()
            delta = stats_delta(before, pipe.stats())
            delta["consumer_cpu_ns"] = int((cpu_after[0] - cpu_before[0]) * 1e9)
            delta["loop_cpu_ns"] = int((cpu_after[1] - cpu_before[1]) * 1e9)
            delta["passes"] = 1
            total = stats.setdefault(name, dict.fromkeys(delta, 0))
            for k, v in delta.items():
                total[k] += v

        return case

    bar.add_total(len(cases) * (reps + warmup))
    run_interleaved(
        {k: with_stats(k, f) for k, f in cases.items()}, timings, reps, warmup, bar=bar
    )
    floor = timings["hand-written MGET 64x4 (uvloop)"]
    naive = timings["naive sync GET + pickle.loads"]
    return {
        "timings": {k: t.as_dict() for k, t in timings.items()},
        "ratio_vs_hand_written": {k: ratio(t, floor) for k, t in timings.items()},
        "cpu_ratio_vs_hand_written": {k: cpu_ratio(t, floor) for k, t in timings.items()},
        "ratio_vs_naive": {k: ratio(t, naive) for k, t in timings.items()},
        "pipe_stats_per_case": stats,
    }


def _run_with_work(
    dp: Any, source: Sequence[bytes], n: int, reps: int, bar: Progress
) -> dict[str, Any]:
    ref = dict(enumerate(source[:n]))
    numpy_work = NumpyWork(WORK_S)
    out: dict[str, Any] = {"numpy_work_elements": numpy_work.size}
    for label, work in (("time.sleep(100us)", sleep_work), ("numpy.sin ~100us", numpy_work)):
        cases = {
            "dict": lambda w=work: fail_if_incomplete("dict", consume_with_work(ref, n, w), n),
            "pipe": lambda w=work: fail_if_incomplete("pipe", consume_with_work(dp, n, w), n),
        }
        timings = {k: Timing(f"{label} {k}", n, VALUE_BYTES) for k in cases}
        before = dp.stats()
        bar.add_total(len(cases) * (reps + 1))
        run_interleaved(cases, timings, reps, warmup=1, bar=bar)
        out[label] = {
            "timings": {k: t.as_dict() for k, t in timings.items()},
            "per_item_us_dict": timings["dict"].median / n * 1e6,
            "per_item_us_pipe": timings["pipe"].median / n * 1e6,
            "time_ratio": timings["pipe"].median / timings["dict"].median,
            "pipe_stats": stats_delta(before, dp.stats()),
        }
    gc.collect()
    return out


# --------------------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    if "skipped" in results:
        return f"### datapipe\n\nskipped: {results['skipped']}\n"
    cfg = results["config"]
    ac_ = results["a_c"]
    out = [
        f"### AsyncKVCacheMapDataPipe warm reads on {cfg['server']}: {cfg['items']:,} x "
        f"{cfg['value_bytes']} B, median of {cfg['reps']}",
        "",
        "CPU: whole process; split: consumer + loop thread (µs/item); stalls and direct "
        "reads per pass.",
        "",
    ]
    rows = []
    for name, t in ac_["timings"].items():
        st = ac_["pipe_stats_per_case"].get(name, {})
        per_pass = st.get("passes") or 1
        split = ""
        if st:
            items = t["items"] * per_pass
            split = (
                f"{st['consumer_cpu_ns'] / items / 1e3:.2f} + {st['loop_cpu_ns'] / items / 1e3:.2f}"
            )
        rows.append(
            [
                name.strip(),
                f"{t['items']:,}",
                f"{t['median_s'] * 1e3:.1f}",
                fmt_rate(t["items_per_s"]),
                f"{ac_['ratio_vs_hand_written'][name]:.2f}",
                f"{ac_['ratio_vs_naive'][name]:.1f}",
                f"{t['cpu_us_per_item']:.2f}",
                split,
                str(st["stalls"] // per_pass) if st else "",
                str(st["direct_reads"] // per_pass) if st else "",
            ]
        )
    out.append(
        markdown_table(
            [
                "case",
                "items",
                "ms",
                "items/s",
                "÷ hand-written",
                "÷ naive",
                "CPU µs/item",
                "split µs/item",
                "stalls",
                "direct reads",
            ],
            rows,
        )
    )
    b = results["b"]
    rows = []
    for label in ("time.sleep(100us)", "numpy.sin ~100us"):
        w = b[label]
        rows.append(
            [
                label,
                f"{w['timings']['dict']['items']:,}",
                f"{w['per_item_us_dict']:.1f}",
                f"{w['per_item_us_pipe']:.1f}",
                f"{w['time_ratio']:.3f}",
                str(w["pipe_stats"]["stalls"]),
                f"{w['pipe_stats']['stall_us'] / 1e3:.1f}",
            ]
        )
    out += [
        "",
        f"(b) consumer with GIL-free work per item (numpy.sin over "
        f"{b['numpy_work_elements']:,} float64):",
        "",
    ]
    out.append(
        markdown_table(
            ["work", "items", "dict µs/item", "pipe µs/item", "pipe/dict", "stalls", "stall ms"],
            rows,
        )
    )
    if "profile" in results:
        out += ["", _profile_text(results["profile"])]
    a_name = "(a) dp[i] sequential, prefetch=64"
    r_hw = ac_["ratio_vs_hand_written"][a_name]
    r_naive = ac_["ratio_vs_naive"][a_name]
    out += ["", "Ratios, same run:", ""]
    out.append(f"- (a) dp[i] ÷ hand-written MGET {r_hw:.2f}, ÷ naive sync GET {r_naive:.1f}")
    for label in ("time.sleep(100us)", "numpy.sin ~100us"):
        out.append(f"- (b) {label}: pipe time ÷ dict time {b[label]['time_ratio']:.3f}")
    return "\n".join(out) + "\n"


def _profile_text(profile: dict[str, Any]) -> str:
    lines = [
        f"Profile of (a), {profile['tool']}, {profile['passes']} passes in "
        f"{profile['workload_s']:.1f} s ({profile['note']}):",
        "",
        "```",
    ]
    for name, th in profile["threads"].items():
        samples = f", {th['samples']} samples" if th.get("samples") else ""
        lines.append(f"{name}{samples} — self:")
        lines += [f"  {share * 100:5.1f}%  {frame}" for frame, share in th["top_self"][:10]]
        lines.append(f"{name} — inclusive:")
        lines += [f"  {share * 100:5.1f}%  {frame}" for frame, share in th["top_inclusive"][:10]]
    lines.append("```")
    return "\n".join(lines)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    if "skipped" in results:
        return []
    ac_ = results["a_c"]
    groups = {
        "÷ hand-written MGET": {k.strip(): v for k, v in ac_["ratio_vs_hand_written"].items()},
        "÷ naive GET": {
            k.strip(): v for k, v in ac_["ratio_vs_naive"].items() if not k.startswith("naive")
        },
    }
    return [
        plots.bars(
            out_dir / "datapipe_ratios.png",
            groups,
            title="AsyncKVCacheMapDataPipe warm reads, 100 B values (items/s ratios)",
            xlabel="ratio (> 1: faster than the reference)",
        )
    ]
