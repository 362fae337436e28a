"""A deep copy of a pipe or node is a new pipeline; a pickled copy is the same one.

``val = copy.deepcopy(train)`` followed by another transform is how people build a second
pipeline from a first. Without ``namespace=`` the copy must not read the original's values
(issue 30: on ca9d281 8 of 8 values were train's). Pickling, which is how DataLoader
workers and epochs get their copies, must keep sharing the namespace.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
from torch.utils.data.datapipes.map import SequenceWrapper
from torchdata.nodes import IterableWrapper

import asynccache as ac
from asynccache.nodes import CachedMapper
from asynccache.testing import servers

N = 8


def train_fn(x: int) -> tuple[str, int]:
    return ("train", x)


def val_fn(x: int) -> tuple[str, int]:
    return ("val", x)


def test_deep_copy_of_a_pipe_without_namespace_reads_its_own_values(
        redis_server: servers.RedisServer) -> None:
    with SequenceWrapper(range(N)).map(train_fn).async_kv_cache(
            ac.connect(redis_server.url), prefetch=4) as train:
        # __getitems__ waits for its writes: the values are in the store before the copy
        assert train.__getitems__(list(range(N))) == [("train", i) for i in range(N)]
        val = copy.deepcopy(train)
        val.source.fn = val_fn  # the Mapper of the copy: another transform
        with val:
            assert val.namespace != train.namespace
            assert val.namespace.startswith("anon-")
            assert val.key_for(3) != train.key_for(3)
            assert [val[i] for i in range(N)] == [("val", i) for i in range(N)]
        # and the original is untouched by the copy
        assert [train[i] for i in range(N)] == [("train", i) for i in range(N)]


def test_pickled_pipe_shares_the_namespace_and_a_named_deep_copy_keeps_it(
        redis_server: servers.RedisServer) -> None:
    client = ac.connect(redis_server.url)
    with SequenceWrapper(range(N)).map(train_fn).async_kv_cache(client) as pipe:
        clone = pickle.loads(pickle.dumps(pipe))
        assert clone.namespace == pipe.namespace
        assert clone.key_for(5) == pipe.key_for(5)
    with SequenceWrapper(range(N)).map(train_fn).async_kv_cache(
            client, namespace="deepcopy-named-v1") as named:
        twin = copy.deepcopy(named)
        assert twin.namespace == "deepcopy-named-v1"
        assert twin.key_for(5) == named.key_for(5)
        twin.close()


def _node(client: ac.BaseClient[Any], fn: Any, namespace: str | None = None) -> CachedMapper:
    return CachedMapper(IterableWrapper(range(N)), fn, client, prefetch=4,
                        namespace=namespace)


@pytest.mark.parametrize("named", [False, True])
def test_deep_copy_of_a_node(redis_server: servers.RedisServer, named: bool) -> None:
    client = ac.connect(redis_server.url)
    node = _node(client, train_fn, "deepcopy-node-v1" if named else None)
    try:
        node.reset()
        assert list(node) == [("train", i) for i in range(N)]
        twin = copy.deepcopy(node)
        clone = pickle.loads(pickle.dumps(node))
        assert clone.namespace == node.namespace
        if named:
            assert twin.namespace == node.namespace
            twin.close()
            return
        twin.map_fn = val_fn
        try:
            assert twin.namespace != node.namespace
            twin.reset()
            assert list(twin) == [("val", i) for i in range(N)]
        finally:
            twin.close()
    finally:
        node.close()
