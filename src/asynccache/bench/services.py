"""An async web service under load: asynccache against aiocache and plain redis.asyncio.

The same aiohttp service three times (`asynccache.bench.service_app`), each in its own
process, each caching the same slow lookup (20 ms) in the same private Redis:

* ``asynccache``: `AsyncKVCache.get_or_compute`;
* ``aiocache``: aiocache's ``@cached`` on a ``RedisCache``;
* ``redis``: plain ``redis.asyncio``, ``GET`` and on a miss ``SET``.

Each is warmed (every key requested once, then a short ``wrk`` run), then measured with
``wrk -t2 -c64 --latency`` over random keys of that warm set, in rounds: every round
runs the three one after the other, the order rotated from round to round so that drift
on the machine lands on each alike. Reported per service: requests/s, p50 and p99
latency (medians over the rounds, as wrk measures them), errors, the service's RSS, and
the **stampede count**: how many times the lookup ran for 200 concurrent requests of one
key nobody asked for before (1 is a cache that coalesces; 200 is one lookup per request).

Also the cost of ``import asynccache`` in a fresh interpreter (time and RSS, whether
torch or numpy came along), the median of a few runs: a service pays it at every start.

Needs ``wrk`` (Debian/Ubuntu: ``apt-get install wrk``), aiohttp and aiocache (the
``bench`` extra); without them the module is skipped with a note. Nothing is asserted on
timings; on a busy machine the numbers mean little, the ratios a little more.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from ..testing import servers
from . import plots
from ._common import BenchError, Session, Skipped, fmt_rate, markdown_table, progress_bar

__all__ = ["import_cost", "parse_wrk", "plot", "run", "table"]

#: the services, in the order of the first round
KINDS = ("asynccache", "aiocache", "redis")
LABELS = {
    "asynccache": "asynccache get_or_compute",
    "aiocache": "aiocache @cached",
    "redis": "redis.asyncio GET/SET",
}
CONNECTIONS = 64
THREADS = 2
STAMPEDE = 200
#: per mode (full, quick, smoke)
ROUNDS = (5, 3, 1)
SECONDS = (15, 6, 1)
WARM_SECONDS = (3, 2, 1)
KEYS = (2000, 1000, 100)
IMPORT_RUNS = (7, 5, 2)
#: seconds a service may take to print its port
START_TIMEOUT = 60.0


# ---------------------------------------------------------------------------- wrk output

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}  # -> milliseconds
_DURATION = re.compile(r"([\d.]+)(us|ms|s|m|h)\b")


def _ms(text: str) -> float:
    found = _DURATION.fullmatch(text.strip())
    if found is None:
        raise BenchError(f"not a wrk duration: {text!r}")
    return float(found.group(1)) * _UNITS[found.group(2)]


def _count(text: str) -> float:
    """wrk's counts: ``6.30k``, ``1.2M``, ``500.00``."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1.0)
    return float(text[:-1] if scale != 1.0 else text) * scale


def parse_wrk(text: str) -> dict[str, Any]:
    """The numbers of a ``wrk --latency`` report: requests/s, latency percentiles (ms),
    requests, duration, socket errors and non-2xx/3xx responses. Raises BenchError when
    the report lacks requests/s or the latency distribution (wrk failed)."""
    out: dict[str, Any] = {"latency_ms": {}, "socket_errors": {}, "non_2xx": 0}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "Requests/sec:":
            out["requests_per_s"] = float(words[1])
        elif re.fullmatch(r"\d+(\.\d+)?%", words[0]) and len(words) == 2:
            percent = float(words[0].rstrip("%"))
            out["latency_ms"][f"p{percent:g}"] = _ms(words[1])
        elif words[0] == "Latency" and len(words) >= 4:
            out["latency_mean_ms"] = _ms(words[1])
            out["latency_max_ms"] = _ms(words[3])
        elif len(words) >= 4 and words[1] == "requests" and words[2] == "in":
            out["requests"] = int(words[0])
            out["duration_s"] = _ms(words[3].rstrip(",")) / 1e3
        elif line.strip().startswith("Socket errors:"):
            for name, value in re.findall(r"(connect|read|write|timeout) (\d+)", line):
                out["socket_errors"][name] = int(value)
        elif line.strip().startswith("Non-2xx or 3xx responses:"):
            out["non_2xx"] = int(words[-1])
        elif words[0] == "Req/Sec" and len(words) >= 2:
            out["requests_per_s_per_thread"] = _count(words[1])
    if "requests_per_s" not in out or "p99" not in out["latency_ms"]:
        raise BenchError(f"wrk gave no requests/s or latency distribution:\n{text}")
    out["errors"] = out["non_2xx"] + sum(out["socket_errors"].values())
    return out


# ---------------------------------------------------------------------------- import cost

_IMPORT_PROBE = """
import importlib.util, json, sys, time

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

before = rss_kib()
started = time.perf_counter()
import asynccache
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "rss_before_kib": before, "rss_after_kib": rss_kib(),
                  "torch_imported": "torch" in sys.modules,
                  "numpy_imported": "numpy" in sys.modules,
                  "torch_installed": importlib.util.find_spec("torch") is not None,
                  "modules": len(sys.modules), "version": asynccache.__version__}))
"""


def import_cost(runs: int) -> dict[str, Any]:
    """``import asynccache`` in ``runs`` fresh interpreters: median seconds and RSS."""
    if not Path("/proc/self/status").exists():
        return {"skipped": "needs /proc (Linux) to read the RSS"}
    samples = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True,
                              text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise BenchError(f"`import asynccache` failed in a fresh interpreter:\n{done.stderr}")
        samples.append(json.loads(done.stdout))
    last = samples[-1]
    return {
        "runs": runs,
        "seconds": statistics.median(s["seconds"] for s in samples),
        "seconds_all": [s["seconds"] for s in samples],
        "rss_mib": statistics.median(s["rss_after_kib"] for s in samples) / 1024,
        "rss_added_mib": statistics.median(
            s["rss_after_kib"] - s["rss_before_kib"] for s in samples) / 1024,
        "torch_imported": last["torch_imported"],
        "numpy_imported": last["numpy_imported"],
        "torch_installed": last["torch_installed"],
        "modules": last["modules"],
    }


# ------------------------------------------------------------------------------- services


class Service:
    """One service process: started with its kind and the Redis URL, stopped on exit."""

    def __init__(self, kind: str, url: str, log_dir: Path) -> None:
        self.kind = kind
        self.log_path = log_dir / f"service-{kind}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asynccache.bench.service_app", kind, url],
            stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL)
        self.port = self._read_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def _read_port(self) -> int:
        import selectors

        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(START_TIMEOUT):
                self.stop()
                raise BenchError(f"the {self.kind} service printed no port in "
                                 f"{START_TIMEOUT:g} s; see {self.log_path}")
        line = self.proc.stdout.readline().decode().strip()
        if not line.isdigit():
            self.stop()
            raise BenchError(f"the {self.kind} service did not start ({line!r}): "
                             f"{self.log_path.read_text(errors='replace')[-1500:]}")
        return int(line)

    def log_tail(self, chars: int = 1500) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def rss_mib(self) -> float | None:
        try:
            with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@contextlib.contextmanager
def _services(url: str, log_dir: Path) -> Iterator[dict[str, Service]]:
    started: dict[str, Service] = {}
    try:
        for kind in KINDS:
            started[kind] = Service(kind, url, log_dir)
        yield started
    finally:
        for service in started.values():
            service.stop()


async def _get_all(service: Service, paths: Sequence[str], concurrency: int) -> list[bytes]:
    """GET every path (``concurrency`` at a time); every answer must be 200."""
    import aiohttp

    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(path: str) -> bytes:
            async with limit, session.get(service.base + path) as response:
                body = await response.read()
                if response.status != 200:
                    raise BenchError(f"the {service.kind} service answered GET {path} with "
                                     f"HTTP {response.status}: {body[:200]!r}; its log: "
                                     f"{service.log_tail()}")
                return body

        return await asyncio.gather(*(one(p) for p in paths))


def warm(service: Service, keys: int) -> None:
    """Every key requested once: the values are in Redis before wrk runs."""
    asyncio.run(_get_all(service, [f"/item/{k}" for k in range(keys)], 32))


def stampede(service: Service, n: int = STAMPEDE) -> int:
    """How many times the lookup ran for ``n`` concurrent requests of one cold key."""

    async def go() -> int:
        before = json.loads((await _get_all(service, ["/computed"], 1))[0])["computed"]
        key = f"cold-{os.urandom(6).hex()}"
        bodies = await _get_all(service, [f"/item/{key}"] * n, n)
        if len(set(bodies)) != 1:
            raise BenchError(f"{service.kind}: concurrent requests of one key got different "
                             "answers")
        after = json.loads((await _get_all(service, ["/computed"], 1))[0])["computed"]
        return int(after - before)

    return asyncio.run(go())


def _lua(path: Path, keys: int) -> Path:
    """A wrk script asking for random keys of the warm set."""
    path.write_text(
        f"local keys = {keys}\n"
        "request = function()\n"
        '  return wrk.format("GET", "/item/" .. math.random(0, keys - 1))\n'
        "end\n",
        encoding="ascii",
    )
    return path


def run_wrk(wrk: str, service: Service, seconds: int, script: Path) -> dict[str, Any]:
    command = [wrk, f"-t{THREADS}", f"-c{CONNECTIONS}", f"-d{seconds}s", "--latency",
               "-s", str(script), service.base + "/"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60,
                          check=False)
    if done.returncode != 0:
        raise BenchError(f"wrk failed ({done.returncode}): {done.stderr or done.stdout}")
    return parse_wrk(done.stdout)


def rotated(kinds: Sequence[str], round_no: int) -> list[str]:
    """The order of round ``round_no``: each round starts one service later."""
    shift = round_no % len(kinds)
    return [*kinds[shift:], *kinds[:shift]]


# --------------------------------------------------------------------------------- public


def _missing() -> str | None:
    if shutil.which("wrk") is None:
        return "wrk is not installed (Debian/Ubuntu: apt-get install wrk)"
    for package in ("aiohttp", "aiocache"):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed: pip install 'asynccache[bench]'"
    return None


@contextlib.contextmanager
def _redis() -> Iterator[servers.RedisServer]:
    """A private redis-server (else whatever Redis-compatible server there is)."""
    try:
        server = servers.start_redis(prefer="redis")
    except servers.ServerNotFound:
        server = servers.start_redis()
    with server:
        yield server


def run(
    *, quick: bool, out_dir: Path, progress: bool, session: Session | None = None
) -> dict[str, Any]:
    """Import cost, then the three services under wrk; JSON-able results. Raises
    Skipped when wrk, aiohttp or aiocache is missing."""
    reason = _missing()
    if reason is not None:
        raise Skipped(reason)
    wrk = shutil.which("wrk")
    assert wrk is not None
    mode = session.mode_index if session is not None else (1 if quick else 0)
    rounds, seconds, keys = ROUNDS[mode], SECONDS[mode], KEYS[mode]
    results: dict[str, Any] = {
        "config": {
            "rounds": rounds, "seconds": seconds, "warm_seconds": WARM_SECONDS[mode],
            "keys": keys, "connections": CONNECTIONS, "threads": THREADS,
            "stampede_requests": STAMPEDE, "lookup_ms": 20, "wrk": _wrk_version(wrk),
        },
        "services": {},
    }
    total = 1 + len(KINDS) * (3 + rounds)  # import; warm, wrk warm-up, stampede; rounds
    with progress_bar(total, "services: import asynccache", progress) as bar:
        results["import"] = import_cost(IMPORT_RUNS[mode])
        bar.update()
        with _redis() as redis, tempfile.TemporaryDirectory(prefix="asynccache-svc-") as tmp:
            results["config"]["server"] = f"{redis.kind} {redis.version}"
            script = _lua(Path(tmp) / "keys.lua", keys)
            with _services(redis.url, Path(tmp)) as running:
                rows: dict[str, dict[str, Any]] = {
                    kind: {"label": LABELS[kind], "rounds": []} for kind in KINDS}
                for kind, service in running.items():
                    bar.describe(f"services: warming {kind}")
                    warm(service, keys)
                    bar.update()
                    run_wrk(wrk, service, WARM_SECONDS[mode], script)
                    bar.update()
                    bar.describe(f"services: stampede on {kind}")
                    rows[kind]["stampede_computations"] = stampede(service)
                    bar.update()
                for round_no in range(rounds):
                    bar.rep(round_no + 1, rounds)
                    for kind in rotated(KINDS, round_no):
                        bar.describe(f"services: wrk on {kind}, round {round_no + 1}/{rounds}")
                        rows[kind]["rounds"].append(run_wrk(wrk, running[kind], seconds, script))
                        bar.update()
                for kind, service in running.items():
                    rows[kind]["rss_mib"] = service.rss_mib()
                    rows[kind].update(_medians(rows[kind]["rounds"]))
                results["services"] = rows
    results["ratios"] = _ratios(results["services"])
    return results


def _wrk_version(wrk: str) -> str:
    done = subprocess.run([wrk, "--version"], capture_output=True, text=True, check=False)
    return (done.stdout or done.stderr).split("\n", 1)[0].strip()


def _medians(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "requests_per_s": statistics.median(r["requests_per_s"] for r in rounds),
        "p50_ms": statistics.median(r["latency_ms"]["p50"] for r in rounds),
        "p99_ms": statistics.median(r["latency_ms"]["p99"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
    }


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """asynccache's figures over each peer's: requests/s (> 1: more) and p99 (< 1: lower)."""
    ours = rows["asynccache"]
    return {
        peer: {
            "requests_per_s_ratio": ours["requests_per_s"] / rows[peer]["requests_per_s"],
            "p99_ratio": ours["p99_ms"] / rows[peer]["p99_ms"],
        }
        for peer in KINDS[1:]
    }


def _ms_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def table(results: dict[str, Any]) -> str:
    c = results["config"]
    out = [
        f"### Services under `wrk -t{c['threads']} -c{c['connections']} --latency`: "
        f"{c['rounds']} round{'s' if c['rounds'] != 1 else ''} of {c['seconds']} s, rotated; "
        f"same {c.get('server', 'Redis')}, "
        f"warm ({c['keys']:,} keys), lookup {c['lookup_ms']} ms on a miss",
        "",
    ]
    rows = []
    for row in results["services"].values():
        rows.append([
            row["label"], fmt_rate(row["requests_per_s"]), _ms_text(row["p50_ms"]),
            _ms_text(row["p99_ms"]), f"{row['errors']:,}",
            f"{row['stampede_computations']}/{c['stampede_requests']}",
            "-" if row.get("rss_mib") is None else f"{row['rss_mib']:.0f}",
        ])
    out.append(markdown_table(
        ["service", "req/s", "p50 ms", "p99 ms", "errors",
         "lookups in a stampede", "RSS MiB"], rows))
    ratios = results.get("ratios", {})
    if ratios:
        out += ["", "asynccache ÷ " + "; ÷ ".join(
            f"{LABELS[peer]}: req/s {r['requests_per_s_ratio']:.2f}×, "
            f"p99 {r['p99_ratio']:.2f}×" for peer, r in ratios.items())]
    imp = results.get("import", {})
    if "seconds" in imp:
        came = ", ".join(n for n in ("torch", "numpy") if imp[f"{n}_imported"])
        installed = "installed" if imp["torch_installed"] else "not installed"
        out += ["", f"`import asynccache` in a fresh interpreter: {imp['seconds'] * 1e3:.0f} ms, "
                f"RSS {imp['rss_mib']:.0f} MiB (+{imp['rss_added_mib']:.0f} MiB), "
                f"{imp['modules']} modules; imported along: {came or 'neither torch nor numpy'} "
                f"(torch {installed}); median of {imp['runs']} runs"]
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    rows = results["services"]
    rate = {"req/s": {row["label"]: row["requests_per_s"] for row in rows.values()}}
    p99 = {"p99 ms": {row["label"]: row["p99_ms"] for row in rows.values()},
           "p50 ms": {row["label"]: row["p50_ms"] for row in rows.values()}}
    return [
        plots.bars(out_dir / "services_requests_per_s.png", rate,
                   title=f"aiohttp service under wrk -c{CONNECTIONS} (req/s, higher is better)",
                   xlabel="requests/s", reference=None),
        plots.bars(out_dir / "services_latency_ms.png", p99,
                   title=f"aiohttp service under wrk -c{CONNECTIONS} (latency, lower is better)",
                   xlabel="ms", reference=None),
    ]
