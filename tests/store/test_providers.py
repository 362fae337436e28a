"""Third-party providers: the Provider base, register_scheme, entry points, and the whole
stack (pipe, node, failure rules) over LMDB and a provider from outside the package."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from torchdata.nodes import Loader, SamplerWrapper

import asynccache as ac
from asynccache.nodes import CachedMapper
from asynccache.store.lmdb.client import LmdbClient
from asynccache.store.registry import unregister_scheme
from outside_provider.sqlite_store import SqliteStore

TESTS = Path(__file__).resolve().parents[1]  # where outside_provider/ is
SRC = TESTS.parent / "src"


@pytest.fixture(autouse=True)
def _sqlite_scheme() -> Iterator[None]:
    ac.register_scheme("sqlite", SqliteStore.from_url, replace=True)
    yield
    unregister_scheme("sqlite")


class Counted:
    """index -> a value naming it; how many times each index was computed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: dict[int, int] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.calls[index] = self.calls.get(index, 0) + 1
        return {"i": index, "blob": bytes([index % 251]) * 100, "none": None}


def expected(index: int) -> dict[str, Any]:
    return {"i": index, "blob": bytes([index % 251]) * 100, "none": None}


def provider_url(kind: str, tmp_path: Path, query: str = "") -> str:
    if kind == "lmdb":
        return f"lmdb://{tmp_path}/lmdb?map_size=64MiB{'&' + query if query else ''}"
    return f"sqlite://{tmp_path}/store.db{'?' + query if query else ''}"


# -- register_scheme ----------------------------------------------------------------------
def test_public_names() -> None:
    assert {"Provider", "register_scheme"} <= set(ac.__all__)
    assert issubclass(ac.Provider, ac.BaseClient) and issubclass(LmdbClient, ac.Provider)


@pytest.mark.parametrize("scheme", ["", "1abc", "my store", "my_store", "ä", "a/b"])
def test_a_scheme_must_be_a_url_scheme(scheme: str) -> None:
    with pytest.raises(ac.ConfigError, match="not a URL scheme"):
        ac.register_scheme(scheme, SqliteStore.from_url)


def test_built_ins_and_registered_schemes_are_not_replaced_silently(tmp_path: Path) -> None:
    with pytest.raises(ac.ConfigError, match=r"built-in.*replace=True"):
        ac.register_scheme("redis", SqliteStore.from_url)
    with pytest.raises(ac.ConfigError, match=r"already registered.*SqliteStore"):
        ac.register_scheme("SQLITE", SqliteStore.from_url)
    ac.register_scheme("redis", lambda url, **o: SqliteStore(f"sqlite://{tmp_path}/r.db"),
                       replace=True)
    try:
        assert isinstance(ac.connect("redis://h:1/0"), SqliteStore)
    finally:
        unregister_scheme("redis")
    assert isinstance(ac.connect("redis://h:1/0"), ac.RedisClient)


def test_connect_passes_the_url_and_keyword_options(tmp_path: Path) -> None:
    client = ac.connect(f"SQLite://{tmp_path}/s.db?timeout=0.5&busy_ms=10", max_batch=7)
    assert isinstance(client, SqliteStore)
    assert (client.timeout, client.busy_ms, client.max_batch) == (0.5, 10, 7)
    with pytest.raises(ac.ConfigError, match="colour"):
        ac.connect(f"sqlite://{tmp_path}/s.db", colour="blue")


def test_factory_mistakes_are_config_errors_naming_it(tmp_path: Path) -> None:
    def not_a_client(url: str, **options: Any) -> object:
        return {"url": url}

    def broken(url: str, **options: Any) -> ac.BaseClient:
        raise ValueError("no host in the URL")

    ac.register_scheme("odd", not_a_client)
    ac.register_scheme("broken", broken)
    try:
        with pytest.raises(ac.ConfigError, match=r"not_a_client.*returned a dict"):
            ac.connect("odd://x")
        with pytest.raises(ac.ConfigError, match=r"broken.*ValueError: no host"):
            ac.connect("broken://x")
        with pytest.raises(ac.ConfigError, match="callable"):
            ac.register_scheme("other", "not callable")  # type: ignore[arg-type]
    finally:
        unregister_scheme("odd")
        unregister_scheme("broken")


def test_unknown_scheme_lists_built_in_and_registered_ones() -> None:
    with pytest.raises(ac.InvalidURL) as info:
        ac.connect("nosuch://x")
    message = str(info.value)
    assert "'nosuch'" in message and "redis://" in message and "lmdb://" in message
    assert "registered by providers: sqlite" in message


# -- the Provider base ----------------------------------------------------------------------
class Slow(ac.Provider):
    """Every operation fails in its own way: what the guard must turn into StoreErrors."""

    scheme = "slow"

    def __init__(self, url: str | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        self.opened: list[int] = []

    def open_connection(self) -> dict[str, Any]:
        self.opened.append(id(asyncio.get_running_loop()))
        return {"closed": False}

    async def close_connection(self, conn: dict[str, Any]) -> None:
        conn["closed"] = True

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        await asyncio.sleep(60)
        return []

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        raise KeyError("a provider bug")

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        raise ac.StoreUnavailable("down")

    async def ping(self) -> None:
        self.last = self.connection


def test_operations_are_bounded_and_foreign_errors_translated() -> None:
    client = Slow("slow://u:hunter2@h", timeout=0.1)
    assert client.safe_url == "slow://u:***@h" and "hunter2" not in repr(client)

    async def main() -> None:
        opened_before = len(client.opened)
        with pytest.raises(ac.StoreTimeout, match=r"get_many within 0.1s"):
            await client.get_many([b"k"])
        with pytest.raises(ac.StoreError, match=r"Slow.set_many raised KeyError") as info:
            await client.set_many({b"k": b"v"})
        assert isinstance(info.value.__cause__, KeyError)
        with pytest.raises(ac.StoreUnavailable, match="down"):
            await client.delete_many([b"k"])
        with pytest.raises(NotImplementedError):  # no add_many: leases are off
            await client.add_many({b"k": b"v"}, 1)
        assert await client.server_info() == {"provider": f"{__name__}.Slow",
                                              "scheme": "slow", "max_value_size": None}
        await client.ping()
        await client.ping()
        conn = client.last
        assert len(client.opened) == opened_before + 1  # once per loop
        await client.close()
        assert conn["closed"]

    asyncio.run(main())
    asyncio.run(main())  # another loop: a connection of its own
    assert len(client.opened) == 2
    with pytest.raises(RuntimeError, match="per event loop"):
        client.connection  # noqa: B018


def test_a_blocking_operation_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match="must be an `async def`"):
        class Blocking(ac.Provider):
            def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:  # type: ignore[override]
                return []


class Garbled(ac.Provider):
    """A dict store whose get_many reply can be garbled on purpose (a provider bug)."""

    scheme = "garbled"

    def __init__(self, url: str | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        self.data: dict[bytes, bytes] = {}
        self.garble = "none"

    async def get_many(self, keys: Sequence[bytes]) -> Any:
        values: list[Any] = [self.data.get(k) for k in keys]
        if self.garble == "short":
            return values[1:]  # the first key's value dropped: the rest would shift
        if self.garble == "long":
            return [self.data.get(keys[0]), *values]
        if self.garble == "not bytes":
            return [None if v is None else v.decode("latin-1") for v in values]
        if self.garble == "not a list":
            return 42
        if self.garble == "SystemExit":
            raise SystemExit(3)  # e.g. a library calling sys.exit() on a lost connection
        if self.garble == "KeyboardInterrupt":
            raise KeyboardInterrupt
        return values

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        self.data.update(mapping)

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.data.pop(k, None)

    async def ping(self) -> None:
        pass

    async def contains_many(self, keys: Sequence[bytes]) -> Any:
        found = [k in self.data for k in keys]
        return found[:-1] if self.garble == "short" else found


@pytest.mark.parametrize("garble", ["short", "long", "not bytes", "not a list"])
def test_a_garbled_get_many_reply_is_a_counted_failure_never_a_wrong_value(garble: str
                                                                          ) -> None:
    client = Garbled()
    source = [f"value {i}" for i in range(40)]

    async def fill() -> None:
        cache = ac.AsyncKVCache(client, "g")
        await cache.set_many(dict(enumerate(source)))
        await cache.aclose()

    asyncio.run(fill())
    assert len(client.data) == 40
    with ac.AsyncKVCacheMapDataPipe(source, client, namespace="g") as dp:
        assert [dp[i] for i in range(40)] == source  # hits
        assert dp.stats()["hits"] == 40
        client.garble = garble
        assert [dp[i] for i in range(40)] == source
        assert [dp[i] for i in reversed(range(40))] == source[::-1]
        stats = dp.stats()
    assert stats["errors"] >= 1

    async def direct() -> None:
        with pytest.raises(ac.StoreError, match=r"Garbled.get_many returned"):
            await client.get_many([b"ac:g:0", b"ac:g:1"])

    asyncio.run(direct())


@pytest.mark.parametrize("garble", ["SystemExit", "KeyboardInterrupt"])
def test_exit_raised_by_a_provider_on_the_loop_thread_is_a_counted_failure(garble: str
                                                                          ) -> None:
    """Off the main thread, a provider's own SystemExit/KeyboardInterrupt would end
    asynccache's loop thread, and every pipe of the process with it."""
    client = Garbled()
    source = [f"value {i}" for i in range(40)]
    with ac.AsyncKVCacheMapDataPipe(source, client, namespace="x") as dp:
        assert [dp[i] for i in range(40)] == source  # computed, written back
        client.garble = garble
        for _ in range(3):  # the loop thread survives: every pass still right
            assert [dp[i] for i in range(40)] == source
        assert dp.stats()["errors"] >= 1

    async def on_the_main_thread() -> None:  # an async service: let it through
        with pytest.raises(SystemExit if garble == "SystemExit" else KeyboardInterrupt):
            await client.get_many([b"ac:x:0"])

    asyncio.run(on_the_main_thread())


def test_a_contains_many_reply_of_the_wrong_length_is_a_store_error() -> None:
    client = Garbled()
    client.garble = "short"

    async def main() -> None:
        with pytest.raises(ac.StoreError, match=r"returned 1 answers for 2 keys"):
            await client.contains_many([b"a", b"b"])

    asyncio.run(main())


# -- the whole stack over LMDB and the outside provider ---------------------------------
@pytest.fixture(params=["lmdb", "sqlite"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_pipe_equals_source_and_second_pass_hits(kind: str, tmp_path: Path,
                                                 namespace: str) -> None:
    source = Counted(150)
    client = ac.connect(provider_url(kind, tmp_path))
    with ac.AsyncKVCacheMapDataPipe(source, client, prefetch=16, namespace=namespace) as dp:
        assert [dp[i] for i in range(len(source))] == [expected(i) for i in range(150)]
        dp.flush()
        first = dp.stats()
        assert [dp[i] for i in reversed(range(len(source)))] == [
            expected(i) for i in reversed(range(150))]
        assert dp.__getitems__([3, 1, 2]) == [expected(3), expected(1), expected(2)]
        stats = dp.stats()
    assert set(source.calls.values()) == {1}  # each computed once, then read back
    assert stats["hits"] - first["hits"] == 153 and stats["errors"] == 0
    # a new client, the same store: the values are still there
    with ac.AsyncKVCacheMapDataPipe(Counted(150), ac.connect(provider_url(kind, tmp_path)),
                                    namespace=namespace) as again:
        assert again[7] == expected(7) and again.stats()["hits"] == 1


def test_node_yields_in_order_and_epoch_two_computes_nothing(kind: str, tmp_path: Path,
                                                             namespace: str) -> None:
    import torch
    from torch.utils.data import RandomSampler

    ds = Counted(80)
    sampler = RandomSampler(range(80), generator=torch.Generator().manual_seed(0))
    node = CachedMapper(SamplerWrapper(sampler), ds.__getitem__,
                        ac.connect(provider_url(kind, tmp_path)), namespace=namespace,
                        prefetch=16)
    loader = Loader(node)
    try:
        first = list(loader)
        order = list(RandomSampler(range(80), generator=torch.Generator().manual_seed(0)))
        assert first == [expected(i) for i in order]
        second = list(loader)
        assert sorted(v["i"] for v in second) == list(range(80))
    finally:
        node.close()
    assert set(ds.calls.values()) == {1}


def test_leases_work_on_providers(kind: str, tmp_path: Path, namespace: str) -> None:
    source = Counted(20)
    with ac.AsyncKVCacheMapDataPipe(source, ac.connect(provider_url(kind, tmp_path)),
                                    namespace=namespace, lease=5) as dp:
        assert dp.__getitems__(list(range(20))) == [expected(i) for i in range(20)]
        stats = dp.stats()
    assert stats["leases"] == 20 and stats["errors"] == 0


# -- failure rules ---------------------------------------------------------------------------
class FaultyLmdb(LmdbClient):
    """LMDB whose reads and writes misbehave as ``fault`` says."""

    def __init__(self, url: str, *, fault: str = "", **options: Any) -> None:
        super().__init__(url, **options)
        self.fault = fault

    def _fail(self) -> None:
        if self.fault == "store_error":
            raise ac.StoreUnavailable("the test asked for a failure")
        if self.fault == "foreign":
            raise ZeroDivisionError("a bug in the provider")

    def read_now(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._fail()
        return super().read_now(keys)

    def consumer_reads(self) -> Any:
        return None if self.fault == "hang" else super().consumer_reads()

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if self.fault == "hang":
            await asyncio.sleep(3600)
        return await super().get_many(keys)

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        self._fail()
        if self.fault == "hang":
            await asyncio.sleep(3600)
        await super().set_many(mapping, ttl)


def faulty(kind: str, fault: str, tmp_path: Path) -> ac.BaseClient:
    if kind == "lmdb":
        return FaultyLmdb(f"lmdb://{tmp_path}/lmdb", fault=fault, timeout=0.2)
    return ac.connect(f"sqlite://{tmp_path}/f.db?fault={fault}&timeout=0.2")


@pytest.mark.parametrize("fault", ["store_error", "foreign", "hang"])
def test_failing_provider_falls_back_counted(kind: str, fault: str, tmp_path: Path,
                                             namespace: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    source = Counted(30)
    with ac.AsyncKVCacheMapDataPipe(source, faulty(kind, fault, tmp_path), prefetch=8,
                                    namespace=namespace) as dp:
        assert [dp[i] for i in range(30)] == [expected(i) for i in range(30)]
        assert dp.__getitems__([0, 1]) == [expected(0), expected(1)]
        dp.flush()
        stats = dp.stats()
    assert stats["errors"] > 0 and stats["hits"] == 0
    if fault == "hang":
        assert stats["timeouts"] > 0
    elif fault == "store_error":
        assert stats["unavailable"] > 0
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert 0 < len(warnings) <= 4  # logged once per kind of failure, not once per item


@pytest.mark.parametrize("fault", ["store_error", "foreign", "hang"])
def test_failing_provider_raises_in_raise_mode(kind: str, fault: str, tmp_path: Path,
                                               namespace: str) -> None:
    dp = ac.AsyncKVCacheMapDataPipe(Counted(5), faulty(kind, fault, tmp_path), prefetch=0,
                                    namespace=namespace, on_error="raise")
    try:
        with pytest.raises(ac.CacheError):
            dp[0]
    finally:
        dp.close()


# -- entry points (a subprocess: a clean metadata cache) ----------------------------------
def _dist_info(root: Path, name: str, entry_points: str) -> None:
    info = root / f"{name.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(entry_points)


def _python(code: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (SRC, TESTS, *paths)))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_entry_point_provides_a_scheme(tmp_path: Path) -> None:
    _dist_info(tmp_path / "site", "asynccache-sqlite-demo", textwrap.dedent("""\
        [asynccache.stores]
        sqlite = outside_provider.sqlite_store:SqliteStore.from_url
        redis = outside_provider.sqlite_store:SqliteStore.from_url
        """))
    done = _python(f"""
        import asyncio, sys
        import asynccache as ac
        assert "outside_provider.sqlite_store" not in sys.modules  # nothing loaded yet
        client = ac.connect("sqlite://{tmp_path}/ep.db?timeout=3")
        assert type(client).__name__ == "SqliteStore" and client.timeout == 3
        assert isinstance(ac.connect("redis://h:1/0"), ac.RedisClient)  # built-in wins
        async def main():
            await client.set_many({{b"k": b"v"}})
            assert await client.get_many([b"k", b"x"]) == [b"v", None]
            await client.close()
        asyncio.run(main())
        with ac.AsyncKVCacheMapDataPipe(list(range(5)), client, namespace="ep") as dp:
            assert [dp[i] for i in range(5)] == list(range(5))
        print("ok")
        """, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_broken_entry_point_names_its_distribution(tmp_path: Path) -> None:
    _dist_info(tmp_path / "site", "broken-store", "[asynccache.stores]\n"
               "broken = outside_provider.nosuch:factory\n")
    _dist_info(tmp_path / "site", "store-a", "[asynccache.stores]\ntwice = a_mod:f\n")
    _dist_info(tmp_path / "site", "store-b", "[asynccache.stores]\ntwice = b_mod:f\n")
    done = _python("""
        import asynccache as ac
        for url in ("broken://x", "twice://x"):
            try:
                ac.connect(url)
            except ac.ConfigError as exc:
                print(exc)
        """, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    broken, twice = done.stdout.strip().splitlines()
    assert "broken-store 1.2.3" in broken and "outside_provider.nosuch" in broken
    assert "ModuleNotFoundError" in broken and "uninstall" in broken
    assert "store-a" in twice and "store-b" in twice and "register_scheme" in twice


# -- the documentation's example provider runs as written ----------------------------------
def test_readme_provider_example_runs(tmp_path: Path) -> None:
    readme = (TESTS.parent / "docs" / "providers.md").read_text()
    block = readme.split("<!-- provider-example:start -->")[1].split(
        "<!-- provider-example:end -->")[0]
    code = block.strip().removeprefix("```python").removesuffix("```")
    assert "class FilesStore(ac.Provider)" in code
    script = tmp_path / "files_store.py"
    script.write_text(code.replace("/tmp/asynccache-files-demo", str(tmp_path / "files")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)}, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "100 hits"
    assert len(list((tmp_path / "files").iterdir())) == 100  # one file per value


class Unfiltered(Garbled):
    """A provider whose scan forgets to filter by prefix (lists the whole store)."""

    scheme = "unfiltered"

    async def scan(self, prefix: bytes, batch: int = 1000) -> Any:
        yield [(key, len(value)) for key, value in sorted(self.data.items())]


def test_a_scan_listing_keys_outside_its_prefix_deletes_nothing_there() -> None:
    from asynccache.cli import flush

    client = Unfiltered()
    client.data = {b"ac:ds:1": b"a", b"ac:ds2:1": b"b", b"session:42": b"c"}

    async def main() -> None:
        with pytest.raises(ac.StoreError, match=r"listed b'ac:ds2:1', which is not under"):
            async for _page in client.scan(b"ac:ds:"):
                pass
        with pytest.raises(ac.StoreError, match="not under that prefix"):
            await flush._delete_as_listed(client, b"ac:ds:")

    asyncio.run(main())
    assert set(client.data) == {b"ac:ds:1", b"ac:ds2:1", b"session:42"}
