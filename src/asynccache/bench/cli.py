"""``asynccache bench``: run the benchmarks, print tables, write JSON, markdown and PNGs.

    asynccache bench [--quick] [--out DIR]
                     [--only goals,core,datapipe,latency,network,dataloader,workers,local,
                             services,ranks,tiered]
                     [--servers redis,valkey,memcached]
                     [--url-redis URL] [--url-valkey URL] [--url-memcached URL]
                     [--reps N] [--no-progress]

Without ``--url-*`` every store is a private server started for the run (127.0.0.1,
persistence off, removed afterwards); with one, that store is used instead (the values
the run writes expire after an hour and are deleted when each measurement ends).
``--quick`` takes under two minutes on a 2-core machine; a full run about ten to
fifteen. Output (``bench-results/`` by default): ``results.json`` (every number, the
machine, the configuration), ``summary.md`` (headline and per-module tables) and PNGs.

Only the standard library and asynccache's own dependencies are imported here, so
``asynccache bench --help`` works without the ``bench`` extra; running it without the
packages a selected benchmark needs is one line naming the extra, before any server
starts.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import MissingDependency
from . import MODULES
from ._common import (
    STORES,
    Skipped,
    busy_note,
    fmt_rate,
    fmt_ratio,
    fmt_size,
    fmt_us,
    machine_line,
    markdown_table,
    open_session,
)

__all__ = ["add_arguments", "headline", "run"]

SCHEMA = "asynccache-bench/1"


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices)}; got {text!r}"
            )
        return list(dict.fromkeys(names))

    parse.__name__ = "list"
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller workloads, 5 repetitions, fewer sweeps (under 2 minutes on 2 cores)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="output directory for results.json, summary.md and the PNGs (default: bench-results/)",
    )
    parser.add_argument(
        "--only",
        type=_names(MODULES),
        default=list(MODULES),
        metavar="LIST",
        help=f"benchmarks to run, comma-separated (default: all of {','.join(MODULES)})",
    )
    parser.add_argument(
        "--servers",
        type=_names(STORES),
        default=None,
        metavar="LIST",
        help=f"stores to measure, comma-separated (default: {','.join(STORES)}; one that "
        "cannot be started is left out with a note unless named here)",
    )
    for name, example in (
        ("redis", "redis://127.0.0.1:6379/0"),
        ("valkey", "redis://127.0.0.1:6380/0"),
        ("memcached", "memcached://127.0.0.1:11211"),
    ):
        parser.add_argument(
            f"--url-{name}",
            metavar="URL",
            help=f"use this existing {name} (e.g. {example}) instead of starting one",
        )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions per measurement (default 7, 5 with --quick)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    # a few-seconds run for the test suite: every code path, meaningless numbers
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    modules = _load(args.only)
    missing = {n: m.package for n, m in modules.items() if isinstance(m, _Missing)}
    if missing:
        packages = ", ".join(sorted({repr(p) for p in missing.values()}))
        raise MissingDependency(
            f"`asynccache bench` needs {packages} (for {', '.join(missing)}), not installed "
            "here: pip install 'asynccache[bench]'")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    # bars on a terminal, a line per stage in a log (cli.progress decides which)
    progress = not args.no_progress
    urls = {n: getattr(args, f"url_{n}") for n in STORES if getattr(args, f"url_{n}")}
    stores = args.servers or list(STORES)
    for name in urls:
        if name not in stores:
            print(
                f"asynccache bench: --url-{name} given but {name} is not in --servers",
                file=sys.stderr,
            )
            return 2
    if args.reps is not None and args.reps < 1:
        print("asynccache bench: --reps must be at least 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "command": _command_line(args),
        "mode": mode,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "modules": {},
    }
    failed = False
    tables: dict[str, str] = {}
    with open_session(
        mode,
        progress=progress,
        stores=stores,
        urls=urls,
        reps=args.reps,
        required=args.servers or (),
    ) as session:
        doc["machine"] = session.machine
        doc["notes"] = session.notes
        print(f"machine: {machine_line(session.machine)}", flush=True)
        for note in session.notes:
            print(f"note: {note}", flush=True)
        for number, name in enumerate(args.only, 1):
            module = modules[name]
            label = f"{name} ({number}/{len(args.only)})"
            entry, table = _run_module(label, module, mode, out_dir, progress, session)
            failed |= "error" in entry
            doc["modules"][name] = entry
            if table:
                tables[name] = table
                print(f"\n{table}", flush=True)
            doc["elapsed_s"] = time.perf_counter() - started
            _write_json(out_dir / "results.json", doc)
    doc["elapsed_s"] = time.perf_counter() - started
    head_md, head = headline(doc)
    doc["headline"] = head
    _write_json(out_dir / "results.json", doc)
    summary = _summary(doc, head_md, tables)
    (out_dir / "summary.md").write_text(summary, encoding="utf-8")
    print(f"\n{head_md}")
    plots = [p for entry in doc["modules"].values() for p in entry.get("plots", [])]
    print(
        f"wrote {out_dir / 'results.json'}, {out_dir / 'summary.md'} and {len(plots)} "
        f"plots in {doc['elapsed_s']:.0f} s ({mode} run)"
    )
    return 1 if failed else 0


class _Missing:
    """A benchmark module that could not be imported: which package was missing."""

    def __init__(self, package: str) -> None:
        self.package = package


def _load(names: Sequence[str]) -> dict[str, Any]:
    """Import the selected modules; a third-party package missing becomes a `_Missing`
    (an import error of ours is a bug, and raised)."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = importlib.import_module(f"asynccache.bench.{name}")
        except ImportError as exc:
            package = (exc.name or "").split(".")[0]
            if package in ("", "asynccache"):
                raise
            out[name] = _Missing(package)
    return out


def _command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (default options left out)."""
    parts = ["asynccache", "bench"]
    if args.smoke:
        parts.append("--smoke")
    elif args.quick:
        parts.append("--quick")
    if args.only != list(MODULES):
        parts += ["--only", ",".join(args.only)]
    if args.servers:
        parts += ["--servers", ",".join(args.servers)]
    for name in STORES:
        if getattr(args, f"url_{name}"):
            parts += [f"--url-{name}", "URL"]  # may hold a password: not repeated here
    if args.reps is not None:
        parts += ["--reps", str(args.reps)]
    if str(args.out) != "bench-results":
        parts += ["--out", str(args.out)]
    return " ".join(parts)


def _run_module(
    name: str, module: Any, mode: str, out_dir: Path, progress: bool, session: Any
) -> tuple[dict[str, Any], str]:
    """Run one benchmark; its failure is recorded, not fatal to the others. A module
    that cannot run here (`Skipped`: a program it needs is missing) is noted."""
    kwargs: dict[str, Any] = {"quick": mode != "full", "out_dir": out_dir, "progress": progress}
    if "session" in inspect.signature(module.run).parameters:
        kwargs["session"] = session
    print(f"\n{name}: running ({mode})...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    entry: dict[str, Any] = {}
    try:
        entry["results"] = module.run(**kwargs)
    except Skipped as exc:
        entry["skipped"] = str(exc)
        print(f"{name}: skipped ({exc})", file=sys.stderr, flush=True)
        return entry, ""
    except Exception as exc:
        entry["error"] = "".join(traceback.format_exception(exc))
        print(f"{name}: FAILED\n{entry['error']}", file=sys.stderr, flush=True)
    entry["elapsed_s"] = time.perf_counter() - started
    print(f"{name}: {entry['elapsed_s']:.1f} s", file=sys.stderr, flush=True)
    if "results" not in entry:
        return entry, ""
    table = ""
    try:
        table = module.table(entry["results"])
        entry["plots"] = [str(p) for p in module.plot(entry["results"], out_dir)]
    except Exception as exc:
        entry["error"] = "".join(traceback.format_exception(exc))
        print(f"{name}: report FAILED\n{entry['error']}", file=sys.stderr, flush=True)
    return entry, table


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(doc), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


# ---------------------------------------------------------------------------- headline


def _best(cases: dict[str, Any], roles: Sequence[str]) -> tuple[str | None, float | None]:
    found = [
        (c["items_per_s"], n) for n, c in cases.items() if c["role"] in roles and not c.get("work")
    ]
    if not found:
        return None, None
    rate, name = max(found)
    return name, rate


def headline(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The summary tables: reads by value size, and p99 per item through the proxy."""
    modules = doc.get("modules", {})
    out: list[str] = []
    head: dict[str, Any] = {"direct": [], "network": []}
    latency = modules.get("latency", {}).get("results") or {}
    if latency.get("by_size"):
        rows = []
        for block in latency["by_size"]:
            c = block["cases"]
            role = {v["role"]: k for k, v in c.items()}
            ours, ours_rate = _best(c, ("asynccache",))
            peer, peer_rate = _best(c, ("naive", "floor", "aiocache"))

            def rate(name: str | None, c: dict[str, Any] = c) -> float | None:
                return c[name]["items_per_s"] if name in c else None

            def ratio(a: str | None, b: str | None, c: dict[str, Any] = c) -> float | None:
                return c[a]["items_per_s"] / c[b]["items_per_s"] if a in c and b in c else None

            row = {
                "store": block["store"],
                "value_bytes": block["value_bytes"],
                "get_many_items_per_s": rate("asynccache get_many"),
                "dp_items_per_s": rate("asynccache dp[i]"),
                "getitems_items_per_s": rate("asynccache __getitems__"),
                "naive_items_per_s": rate(role.get("naive")),
                "floor_items_per_s": rate(role.get("floor")),
                "aiocache_items_per_s": rate(role.get("aiocache")),
                "dict_items_per_s": rate(role.get("dict")),
                "best_asynccache": ours,
                "best_peer": peer,
                "best_asynccache_mb_per_s": c[ours]["mb_per_s"] if ours else None,
                "ratio_best_vs_best_peer": (
                    ours_rate / peer_rate if ours_rate and peer_rate else None),
                "ratio_get_many_vs_floor": ratio("asynccache get_many", role.get("floor")),
                "ratio_getitems_vs_naive": ratio("asynccache __getitems__", role.get("naive")),
                "ratio_dp_vs_naive": ratio("asynccache dp[i]", role.get("naive")),
                "ratio_dp_vs_dict": ratio("asynccache dp[i]", role.get("dict")),
                "p99_item_us_dp": c["asynccache dp[i]"]["item_us"]["p99"],
                "p99_item_us_naive": (
                    c[role["naive"]]["item_us"]["p99"] if "naive" in role else None
                ),
            }
            head["direct"].append(row)
            rows.append(
                [
                    f"{row['store']} {fmt_size(row['value_bytes'])}",
                    fmt_rate(row["get_many_items_per_s"]),
                    fmt_rate(row["dp_items_per_s"]),
                    fmt_rate(row["getitems_items_per_s"]),
                    fmt_rate(row["naive_items_per_s"]),
                    fmt_rate(row["floor_items_per_s"]),
                    fmt_rate(row["aiocache_items_per_s"]),
                    fmt_rate(row["dict_items_per_s"]),
                    fmt_rate(row["best_asynccache_mb_per_s"]),
                    fmt_ratio(row["ratio_best_vs_best_peer"]),
                    fmt_ratio(row["ratio_get_many_vs_floor"]),
                    fmt_ratio(row["ratio_getitems_vs_naive"]),
                    fmt_us(row["p99_item_us_dp"]),
                    fmt_us(row["p99_item_us_naive"]),
                ]
            )
        cfg = latency["config"]
        out += [
            "### Warm reads on loopback: items/s, same run, same server and values",
            "",
            f"asynccache: `get_many` ({cfg['in_flight']} batches in flight), `dp[i]` "
            f"(prefetch={cfg['prefetch']}), `__getitems__` (batches of {cfg['batch']}, "
            f"{cfg['big_value_batch']} for 1 MiB, prefetch={cfg['prefetch']} with set_order). "
            "Peers: naive = `redis-py GET` / `pymemcache get` per key; floor = hand-written "
            "`redis.asyncio` MGET loop / `aiomcache multi_get` (uvloop, same batches and "
            "in-flight); `aiocache multi_get`; `dict + pickle.loads` in process. "
            "best ÷ best: fastest asynccache path over fastest networked peer.",
            "",
            markdown_table(
                [
                    "store value",
                    "get_many",
                    "dp[i]",
                    "__getitems__",
                    "naive",
                    "floor",
                    "aiocache",
                    "dict",
                    "best MB/s",
                    "best ÷ best peer",
                    "get_many ÷ floor",
                    "__getitems__ ÷ naive",
                    "p99 µs/item dp[i]",
                    "p99 µs/item naive",
                ],
                rows,
            ),
        ]
    network = modules.get("network", {}).get("results") or {}
    if network.get("levels"):
        from .network import headline_rows

        rows = []
        net_rows = headline_rows(network)
        head["network"] = net_rows
        for r in net_rows:
            net_ratio = (
                r["items_per_s_dp_prefetch"] / r["items_per_s_naive"]
                if r["items_per_s_naive"]
                else None
            )
            r["ratio_dp_prefetch_vs_naive"] = net_ratio
            rows.append(
                [
                    f"{r['store']} {fmt_size(r['value_bytes'])}",
                    f"+{r['rtt_added_ms']:g} ms",
                    fmt_us(r["ping_us"]),
                    fmt_us(r["p99_dp_prefetch_work_us"]),
                    fmt_us(r["p99_dp_prefetch_us"]),
                    fmt_us(r["p99_dp_deep_prefetch_us"]),
                    fmt_us(r["p99_dp_no_prefetch_us"]),
                    fmt_us(r["p99_naive_us"]),
                    fmt_rate(r["items_per_s_dp_prefetch"]),
                    fmt_rate(r["items_per_s_getitems"]),
                    fmt_rate(r["items_per_s_naive"]),
                    fmt_ratio(net_ratio),
                ]
            )
        cfg = network["config"]
        out += [
            "",
            "### Through a latency proxy: p99 per item at the consumer (µs)",
            "",
            f"`dp[i]` with prefetch {cfg['prefetch']} (+ 100 µs GIL-free work per item, or "
            f"none), {cfg['deep_prefetch']}, 0; naive = one round trip per key. RTT: added "
            "by the proxy; ping: measured round trip through it.",
            "",
            markdown_table(
                [
                    "store value",
                    "RTT",
                    "ping µs",
                    f"p={cfg['prefetch']} + work",
                    f"p={cfg['prefetch']}",
                    f"p={cfg['deep_prefetch']}",
                    "p=0",
                    "naive",
                    f"dp[i] p={cfg['prefetch']} items/s",
                    "__getitems__ items/s",
                    "naive items/s",
                    "dp[i] ÷ naive",
                ],
                rows,
            ),
        ]
        top = max(net_rows, key=lambda r: (r["rtt_added_ms"], r["value_bytes"] == 4096))
        if top["p99_dp_prefetch_work_us"] is not None:
            sentence = (
                f"At +{top['rtt_added_ms']:g} ms RTT ({top['store']}, "
                f"{fmt_size(top['value_bytes'])} values, ping {fmt_us(top['ping_us'])} µs), "
                f"p99 per-item consumer latency of `dp[i]` with prefetch={cfg['prefetch']}: "
                f"{fmt_us(top['p99_dp_prefetch_work_us'])} µs with 100 µs of work per item, "
                f"{fmt_us(top['p99_dp_prefetch_us'])} µs in a tight loop, "
                f"{fmt_us(top['p99_dp_deep_prefetch_us'])} µs with "
                f"prefetch={cfg['deep_prefetch']}; without prefetch "
                f"{fmt_us(top['p99_dp_no_prefetch_us'])} µs, naive GET per key "
                f"{fmt_us(top['p99_naive_us'])} µs."
            )
            head["sentence"] = sentence
            out += ["", f"**Headline:** {sentence}"]
    for name in ("core", "datapipe"):
        res = modules.get(name, {}).get("results") or {}
        line = _target_line(name, res)
        if line:
            head.setdefault("targets", {})[name] = line
    if head.get("targets"):
        out += ["", *(f"- {line}" for line in head["targets"].values())]
    return "\n".join(out) + "\n", head


def _target_line(name: str, res: dict[str, Any]) -> str | None:
    try:
        if name == "core":
            parts = [
                f"{label} {w['ratios_vs_hand_written']['asynccache get_many']:.2f}"
                for label, w in res["workloads"].items()
            ]
            return "core: asynccache get_many ÷ hand-written MGET: " + ", ".join(parts)
        a = "(a) dp[i] sequential, prefetch=64"
        return (
            f"datapipe: dp[i] ÷ hand-written MGET {res['a_c']['ratio_vs_hand_written'][a]:.2f}"
            f", ÷ naive GET {res['a_c']['ratio_vs_naive'][a]:.1f}"
        )
    except (KeyError, TypeError):
        return None


def _summary(doc: dict[str, Any], head_md: str, tables: dict[str, str]) -> str:
    machine = doc.get("machine", {})
    lines = [
        "# asynccache benchmarks",
        "",
        f"- command: `{doc['command']}` "
        f"({doc['mode']} run, {doc.get('elapsed_s', 0):.0f} s, {doc['started_at']})",
        f"- machine: {machine_line(machine)}",
    ]
    note = busy_note(machine)
    if note:
        lines.append(f"- note: {note}")
    lines += [f"- note: {n}" for n in doc.get("notes", [])]
    for name, entry in doc["modules"].items():
        status = (
            "skipped: " + entry["skipped"]
            if "skipped" in entry
            else "FAILED (see results.json)"
            if "error" in entry
            else f"{entry['elapsed_s']:.0f} s"
        )
        lines.append(f"- {name}: {status}")
    lines += ["", "## Headline", "", head_md.rstrip(), ""]
    for name, table in tables.items():
        lines += [f"## {name}", "", table.rstrip(), ""]
    plots = [Path(p).name for entry in doc["modules"].values() for p in entry.get("plots", [])]
    if plots:
        lines += ["## Plots", "", *(f"![{p}]({p})" for p in plots), ""]
    return "\n".join(lines)
