"""A cache's settings are checked once, where they are given (`CacheSettings`), and what
a pipe's copies build their caches from is that very object."""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import pytest

import asynccache as ac
from asynccache.cache.core import AsyncKVCache
from asynccache.cache.keys import Keyspace
from asynccache.cache.settings import CacheSettings

BAD = [
    ({"client": "redis://localhost"}, "client must come from asynccache.connect"),
    ({"on_error": "ignore"}, "on_error must be 'fallback' or 'raise'"),
    ({"l1_bytes": 0}, "l1_bytes must be a positive int"),
    ({"lease": -1}, "lease (the longest one batch"),
    ({"ttl": float("nan")}, "ttl must be a positive, finite duration"),
    ({"max_in_flight": 0}, "max_in_flight must be an int >= 1"),
    ({"max_pending_writes": 1.5}, "max_pending_writes must be an int >= 1"),
]


def _settings(**given: Any) -> CacheSettings:
    fields: dict[str, Any] = {"client": ac.connect("memory://settings"),
                              "keyspace": Keyspace("settings-v1")}
    fields.update(given)
    return CacheSettings(**fields)


@pytest.mark.parametrize(("given", "message"), BAD)
def test_a_wrong_setting_is_a_config_error_saying_what_is_accepted(
        given: dict[str, Any], message: str) -> None:
    with pytest.raises(ac.ConfigError, match=message.replace("(", r"\(")):
        _settings(**given)


@pytest.mark.parametrize(("given", "message"), BAD[1:5])
def test_the_cache_and_the_pipe_say_the_same(given: dict[str, Any], message: str) -> None:
    # one check: the cache's constructor and the pipe's raise the same message
    client = ac.connect("memory://settings")
    with pytest.raises(ac.ConfigError) as from_cache:
        AsyncKVCache(client, "settings-v1", **given)
    with pytest.raises(ac.ConfigError) as from_pipe:
        ac.AsyncKVCacheMapDataPipe([1, 2], client, namespace="settings-v1", **given)
    assert str(from_cache.value) == str(from_pipe.value)


def test_durations_are_held_as_seconds_and_the_default_codec_is_filled_in() -> None:
    settings = _settings(ttl=datetime.timedelta(minutes=2), lease=1)
    assert settings.ttl == 120.0 and settings.lease == 1.0
    assert settings.codec is not None
    unnamed = _settings(keyspace=Keyspace(None))
    assert unnamed.ttl is None and unnamed.store_ttl == 86_400  # an unnamed namespace: a day


def test_a_cache_is_built_from_the_settings_as_given() -> None:
    settings = _settings(ttl=30, l1_bytes=1 << 20, max_pending_writes=7)
    cache = AsyncKVCache.from_settings(settings)
    assert cache.settings is settings
    assert cache.ttl == 30.0 and cache.l1 is not None and cache.writes._max_pending == 7


def test_settings_pickle_with_their_client_as_a_pipe_s_copies_need() -> None:
    settings = _settings(ttl=5, lease=2)
    copy = pickle.loads(pickle.dumps(settings))
    assert (copy.ttl, copy.lease, copy.keyspace.namespace) == (5.0, 2.0, "settings-v1")
    assert copy.client.safe_url == settings.client.safe_url
