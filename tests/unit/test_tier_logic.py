"""``Tiered(near, far)``'s logic on in-process stores: which tier a read asks, what a
key that was not read becomes, what is copied and what is dropped, how writes merge.

The acceptance tests (real servers, killed and black-holed): tests/store/test_tiered.py.
"""

from __future__ import annotations

import asyncio
import datetime
import pickle
from collections.abc import Collection, Mapping
from typing import Any

import pytest

import asynccache as ac
from asynccache.store.api import NOT_READ, STORE_COUNTS, NodeName, WriteResult
from asynccache.store.tiered import Tiered


class Refusing(ac.MemoryClient):
    """A near store that is full: every value refused (as LMDB's MapFull, Redis' OOM)."""

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        self.calls["set_many"] += 1
        return WriteResult(answered=list(self.node_names),
                           rejected={k: ac.StoreRejected("full") for k in entries})


class Down(ac.MemoryClient):
    """A store whose server does not answer."""

    async def get_many(self, keys: Any) -> list[bytes | None]:
        raise ac.StoreUnavailable("connection refused")

    async def set_many(self, mapping: Mapping[bytes, bytes], ttl: float | None = None) -> None:
        raise ac.StoreUnavailable("connection refused")


@pytest.fixture
def stores(request: pytest.FixtureRequest) -> tuple[ac.MemoryClient, ac.MemoryClient]:
    name = request.node.name
    near, far = ac.MemoryClient(name=f"{name}-near"), ac.MemoryClient(name=f"{name}-far")
    near.clear()
    far.clear()
    return near, far


def counted(body: Any) -> tuple[Any, dict[str, int]]:
    """``asyncio.run(body())`` with the store's own counts collected, as a cache does."""
    counts: dict[str, int] = {}

    def add(name: str, n: int) -> None:
        counts[name] = counts.get(name, 0) + n

    async def main() -> Any:
        STORE_COUNTS.set(add)
        return await body()

    return asyncio.run(main()), counts


def test_near_hits_never_ask_far_and_far_hits_are_copied_into_near(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    near, far = stores
    client = Tiered(near, far)

    async def body() -> list[Any]:
        await near.set_many({b"a": b"near-a"})
        await far.set_many({b"a": b"far-a", b"b": b"far-b"})
        first = await client.get_many([b"a", b"a"])
        assert far.calls["get_many"] == 0  # every key hit near
        got = await client.get_many([b"a", b"b", b"c"])
        await client.close()  # copies in flight finish
        return [first, got]

    (first, got), counts = counted(body)
    assert first == [b"near-a", b"near-a"]
    assert got == [b"near-a", b"far-b", None]
    # one far read for near's misses, one checking the copy made (another process may
    # have written the key meanwhile: see Tiered._undo_overtaken)
    assert far.calls["get_many"] == 2
    assert near.data[b"b"][0] == b"far-b" and b"c" not in near.data
    assert counts == {"tier_near_hits": 3, "tier_far_hits": 1, "tier_copies": 1}


def test_a_key_near_lacks_and_far_could_not_read_is_not_read(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    near, far = stores
    client = Tiered(near, far)
    far_node = far.node_names[0]

    async def body() -> Any:
        await near.set_many({b"a": b"A"})
        await far.set_many({b"b": b"B"})
        return await client.read([b"a", b"b"], skip={far_node})

    result, _counts = counted(body)
    assert result.values == [b"A", NOT_READ]  # far may hold b: never a miss to remember
    assert result.skipped == 1 and not result.failures


def test_near_down_reads_everything_from_far_and_reports_near(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    _near, far = stores
    near = Down(name=_near.name)
    client = Tiered(near, far)

    async def body() -> Any:
        await far.set_many({b"b": b"B"})
        return await client.read([b"a", b"b"])

    result, counts = counted(body)
    assert result.values == [None, b"B"]  # far is the store of record: a is absent
    assert set(result.failures) == {near.node_names[0]}
    assert result.answered == [far.node_names[0]]
    assert "tier_copies" not in counts  # never copied into a node that just failed


def test_node_names_are_near_then_far_and_the_same_store_twice_is_refused(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    near, far = stores
    client = Tiered(near, far)
    assert client.node_names == (*near.node_names, *far.node_names)
    assert "near=memory://" in client.safe_url and "far=memory://" in client.safe_url
    with pytest.raises(ac.ConfigError, match="same store"):
        Tiered(near, near)
    with pytest.raises(ac.ConfigError, match="same store"):
        Tiered(near, ac.MemoryClient(name=near.name))
    with pytest.raises(ac.ConfigError, match=r"asynccache\.connect"):
        Tiered("redis://127.0.0.1", far)  # type: ignore[arg-type]
    for bad in (0, -1, float("inf"), "60", True):
        with pytest.raises(ac.ConfigError, match="copy_ttl"):
            Tiered(near, far, copy_ttl=bad)  # type: ignore[arg-type]
    with pytest.raises(ac.ConfigError, match="max_copy_bytes"):
        Tiered(near, far, max_copy_bytes=-1)


def test_settings_come_from_both_tiers() -> None:
    near = ac.MemoryClient(name="n", max_value_size=1000, timeout=0.5, max_batch=64)
    far = ac.MemoryClient(name="f", max_value_size=4000, timeout=2.0, max_batch=256)
    client = Tiered(near, far)
    assert client.max_value_size == 1000  # chunked to fit both
    assert client.timeout == 2.5  # a read may wait for near, then far
    assert client.max_batch == 64
    assert Tiered(ac.MemoryClient(name="n"), ac.MemoryClient(name="f")).max_value_size is None


def test_copies_are_bounded_and_a_full_near_is_left_alone_for_a_while(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    _near, far = stores
    bounded = Tiered(_near, far, max_copy_bytes=150)
    full = Tiered(Refusing(name=_near.name + "-full"), far)

    async def body() -> Any:
        await far.set_many({b"%d" % i: b"x" * 100 for i in range(4)})
        got = await bounded.get_many([b"0", b"1", b"2", b"3"])
        await bounded.close()
        assert got == [b"x" * 100] * 4
        assert len(_near.data) == 1  # one value fits in 150 bytes; the rest were served
        assert await full.get_many([b"0", b"1"]) == [b"x" * 100] * 2
        await asyncio.sleep(0)  # the copy runs, and is refused
        assert await full.get_many([b"2"]) == [b"x" * 100]  # near paused: not asked
        await full.close()
        return full.near.calls["set_many"]

    copies_sent, counts = counted(body)
    assert copies_sent == 1
    assert counts["tier_copies"] == 1
    assert counts["tier_near_refused"] == 2
    assert counts["tier_near_dropped"] == 3 + 1  # over the bound, then near paused


def test_writes_go_to_both_and_the_result_is_fars(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    near, far = stores

    async def body() -> tuple[WriteResult, WriteResult]:
        both = await Tiered(near, far).write({b"k": b"v"}, ttl=60)
        assert near.data[b"k"][0] == b"v" and far.data[b"k"][0] == b"v"
        assert near.data[b"k"][1] is not None and far.data[b"k"][1] is not None  # the ttl
        broken = Tiered(Down(name=near.name + "-down"), far)
        return both, await broken.write({b"j": b"w"})

    (both, near_down), _counts = counted(body)
    assert both.written == 1 and not both.failures and len(both.answered) == 2
    # near's trouble is its node's (counted, backed off), the value is in far: not dropped
    assert near_down.written == 1 and near_down.failed_keys == 0
    assert list(near_down.failures) == [NodeName(f"memory://{near.name}-down")]


def test_leases_are_fars_alone_and_deletes_reach_both(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    near, far = stores
    client = Tiered(near, far)

    async def body() -> list[bool]:
        taken = await client.add_many({b"lease": b"me"}, 30)
        assert b"lease" in far.data and b"lease" not in near.data
        await client.set_many({b"k": b"v"})
        await client.delete_many([b"k", b"lease"])
        assert not near.data and not far.data
        return taken

    assert counted(body)[0] == [True]


def test_contains_and_sizes_ask_far_only_for_what_near_lacks(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    near, far = stores
    client = Tiered(near, far)

    async def body() -> tuple[list[bool], list[int | None]]:
        await near.set_many({b"a": b"1"})
        await far.set_many({b"a": b"1", b"b": b"22"})
        return await client.contains_many([b"a", b"b", b"c"]), await client.sizes_many(
            [b"a", b"b", b"c"])

    (contains, sizes), _counts = counted(body)
    assert contains == [True, True, False] and sizes == [1, 2, None]


def test_a_pickle_carries_both_tiers_and_the_settings(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    near, far = stores
    client = Tiered(near, far, copy_ttl=30, max_copy_bytes=1 << 20)
    asyncio.run(client.get_many([b"x"]))  # per-loop state exists: it must not travel
    clone = pickle.loads(pickle.dumps(client))
    assert isinstance(clone, Tiered) and clone.safe_url == client.safe_url
    assert (clone.copy_ttl, clone.max_copy_bytes) == (30.0, 1 << 20)
    assert clone.near.safe_url == near.safe_url and clone.far.safe_url == far.safe_url
    assert "_states" not in clone.__getstate__()
    assert repr(clone).startswith("Tiered(near=MemoryClient(")


def test_a_cache_counts_the_tiers_in_its_stats(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    near, far = stores

    async def body() -> dict[str, int]:
        async with ac.AsyncKVCache(far, namespace="n") as writer:
            await writer.set_many({i: {"i": i} for i in range(10)})
        cache = ac.AsyncKVCache(Tiered(near, far), namespace="n")
        async with cache:
            assert await cache.get_many(range(10)) == {i: {"i": i} for i in range(10)}
        async with ac.AsyncKVCache(Tiered(near, far), namespace="n") as again:
            assert await again.get_many(range(10)) == {i: {"i": i} for i in range(10)}
            assert again.stats()["tier_near_hits"] == 10
        return cache.stats()

    stats = asyncio.run(body())
    assert stats["hits"] == 10 and stats["errors"] == 0
    assert stats["tier_far_hits"] == 10 and stats["tier_copies"] == 10  # after aclose()


class Small(ac.MemoryClient):
    """A near store with little room: values over ``room`` bytes are refused one by one (as
    a nearly full LMDB map or a Valkey at ``maxmemory`` answers), smaller ones taken."""

    room = 10

    async def write(self, entries: Mapping[bytes, bytes], ttl: float | None = None,
                    skip: Collection[NodeName] = ()) -> WriteResult:
        fits = {k: v for k, v in entries.items() if len(v) <= self.room}
        await self.set_many(fits, ttl)
        return WriteResult(written=len(fits), answered=list(self.node_names),
                           rejected={k: ac.StoreRejected("full")
                                     for k in entries if k not in fits})


@pytest.mark.parametrize("how", ["refused", "paused"])
def test_a_write_near_does_not_take_never_leaves_an_older_value_in_near(
        how: str, stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    """Read your writes: ``set(k, new)`` then ``get(k)`` is ``new``, also when near refused
    ``new`` (full) or was left alone for a while (it refused something else just before):
    near must not keep serving the value it held before."""
    _near, far = stores
    near = Small(name=_near.name + "-small")
    near.clear()
    client = Tiered(near, far)

    async def body() -> list[bytes | None]:
        await client.set_many({b"k": b"old"})
        assert near.data[b"k"][0] == b"old"
        if how == "refused":
            new = b"new" * 10  # over near's room: refused there, taken by far
        else:
            await client.set_many({b"big": b"x" * 100})  # refused: near is paused
            new = b"new"  # would fit, but near is not asked while paused
        await client.set_many({b"k": new})
        got = await client.get_many([b"k"])
        await client.close()
        return [new, *got]

    (new, got), _counts = counted(body)
    assert got == new


class Gated(ac.MemoryClient):
    """A far store whose reads take their values at once and answer when ``gate`` opens:
    a read sent before a write, answered after it (as on any network)."""

    gate: asyncio.Event

    async def get_many(self, keys: Any) -> list[bytes | None]:
        values = await super().get_many(keys)
        await self.gate.wait()
        return values


@pytest.mark.parametrize("then", ["set", "delete"])
def test_a_copy_of_a_value_read_before_a_write_never_lands_over_the_write(
        then: str, stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    """A far read answers ``old``; a write of ``new`` (or a delete) to both tiers completes
    meanwhile; the read's copy of ``old`` must not then land in near, which would serve it
    from then on (``copy_ttl=None``: for ever) though far holds ``new`` (or nothing)."""
    near, _far = stores
    far = Gated(name=_far.name + "-gated")
    far.clear()
    client = Tiered(near, far)

    async def body() -> tuple[list[bytes | None], list[bytes | None]]:
        far.gate = asyncio.Event()
        far.gate.set()
        await far.set_many({b"k": b"old"})
        far.gate.clear()
        reading = asyncio.ensure_future(client.get_many([b"k"]))
        await asyncio.sleep(0.01)  # near missed, far's answer (old) is on its way
        if then == "set":
            await client.set_many({b"k": b"new"})
        else:
            await client.delete_many([b"k"])
        far.gate.set()
        first = await reading  # old: it was read before the write, rightly
        await client.close()  # its copy, if any, landed
        return first, await client.get_many([b"k"])

    (first, after), _counts = counted(body)
    assert first == [b"old"]
    assert after == ([b"new"] if then == "set" else [None])


def test_a_paused_near_backing_off_is_not_asked_to_delete_and_its_failure_is_its_nodes(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    """While near is left alone, a write deletes its keys from near -- but not from a near
    the cache backs off (a black-holed one would cost its timeout on every write), and a
    delete that fails is near's node's failure (so that the cache backs it off)."""
    _near, far = stores

    class Broken(Down):
        async def delete_many(self, keys: Any) -> None:
            self.calls["delete_many"] += 1
            raise ac.StoreUnavailable("connection refused")

    near = Broken(name=_near.name + "-broken")
    client = Tiered(near, far)
    node = near.node_names[0]

    async def body() -> tuple[WriteResult, WriteResult]:
        await client.write({b"a": b"1"})  # near fails: paused
        backing_off = await client.write({b"b": b"2"}, skip={node})
        assert near.calls["delete_many"] == 0
        return backing_off, await client.write({b"c": b"3"})

    (backing_off, asked), _counts = counted(body)
    assert backing_off.written == 1 and not backing_off.failures
    assert near.calls["delete_many"] == 1 and list(asked.failures) == [node]
    assert asked.written == 1 and far.data[b"c"][0] == b"3"


def test_a_copy_of_an_unnamed_namespaces_value_expires_in_near_as_in_far(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    """Values of an unnamed namespace live a day in far (nobody can reuse them after the
    run): a copy of one in near, which may never evict (LMDB), expires with them: the
    reading cache's ttl bounds the copy's (READ_TTL)."""
    near, far = stores

    async def body() -> tuple[bytes, float | None]:
        async with ac.AsyncKVCache(far) as writer:  # unnamed: its values live a day
            await writer.set("k", "v")
        async with ac.AsyncKVCache(Tiered(near, far), namespace=writer.keyspace) as reader:
            assert await reader.get("k") == "v"  # a far hit, copied into near
        key = writer.key("k")
        return key, near.data[key][1]

    key, expires = asyncio.run(body())
    far_expires = far.data[key][1]
    assert far_expires is not None
    assert expires is not None  # not kept for ever in a near that never evicts
    assert expires - far_expires <= 60  # a day, as in far (read a moment after the write)


def test_copy_ttl_takes_a_timedelta_like_every_ttl(
        stores: tuple[ac.MemoryClient, ac.MemoryClient]) -> None:
    """The one TTL rule (seconds or a datetime.timedelta wherever a ttl is accepted)
    holds for ``copy_ttl`` too; what it refuses is still a ConfigError."""
    near, far = stores
    assert Tiered(near, far, copy_ttl=datetime.timedelta(minutes=2)).copy_ttl == 120.0
    with pytest.raises(ac.ConfigError, match="copy_ttl"):
        Tiered(near, far, copy_ttl=datetime.timedelta(0))


@pytest.mark.xfail(strict=True, reason=(
    "mask_text masks from the first scheme:// to the last '@' of the whole message (so it "
    "never masks less than a password, whatever the password holds): a command-line error "
    "naming a tiered client (two URLs with passwords) loses everything between them, and "
    "reads 'tiered(near=<far's host>: <error>'. Masking each URL apart must not let a raw "
    "password with '@', ', ' or '://' through: left to decide in store/credentials.py"))
def test_a_tiered_error_message_keeps_which_tier_failed_after_masking() -> None:
    from asynccache.store.credentials import mask_text

    near = ac.connect("redis://:nearpw@127.0.0.1:6390/0")
    far = ac.connect("redis://:farpw@127.0.0.1:1/0")
    message = (f"flush of ac:ns: on {Tiered(near, far).safe_url} failed: "
               f"{far.safe_url}: connection refused")
    masked = mask_text(message)
    assert "nearpw" not in masked and "farpw" not in masked
    assert masked == message  # already safe: nothing to take out
