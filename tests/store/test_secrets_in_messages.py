"""Passwords appear in no message, whatever characters they hold: ``/ ? # @ : % space``
and non-ASCII, written raw in the URL (not percent-encoded). The userinfo is found
before anything else is parsed (between ``//`` and the last ``@``), so the password is
the right one, and masked in every error, repr, log record, pickle and command output.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

import asynccache as ac
from asynccache.__main__ import main
from asynccache.testing import servers

#: one password per character class; its three words must never appear in any output
CLASSES = {"slash": "/", "question": "?", "hash": "#", "at": "@", "colon": ":",
           "percent": "%", "space": " ", "non-ascii": "é漢"}
WORDS = ("Kiwi7", "Mango8", "Papaya9")


def password_with(char: str) -> str:
    return f"{WORDS[0]}{char}{WORDS[1]}{char}{WORDS[2]}"


@pytest.fixture(params=list(CLASSES), ids=list(CLASSES))
def password(request: pytest.FixtureRequest) -> str:
    return password_with(CLASSES[request.param])


def assert_clean(text: str, password: str) -> None:
    for secret in (password, quote(password, safe=""), *WORDS):
        assert secret not in text, text


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[servers.RedisServer]:
    """A redis with one ACL user per character class (user ``u-<class>``)."""
    with servers.start_redis(prefer="redis") as server:
        for name, char in CLASSES.items():
            server.call("ACL", "SETUSER", f"u-{name}", "on", f">{password_with(char)}",
                        "~*", "+@all")
        yield server


def user_of(password: str) -> str:
    (name,) = [n for n, c in CLASSES.items() if password == password_with(c)]
    return f"u-{name}"


# -- connect() ---------------------------------------------------------------------------
def test_the_raw_password_is_parsed_whole_and_masked(password: str) -> None:
    for url in (f"redis://:{password}@cache.internal:6380/3?timeout=2",
                f"rediss+cluster://:{password}@a:1,b:2",
                f"unix://:{password}@/run/redis.sock?db=2"):
        client = ac.connect(url)
        assert client.password == password
        assert_clean(repr(client) + client.safe_url + repr(pickle.dumps(client)), password)
    client = ac.connect(f"redis://:{password}@cache.internal:6380/3")
    assert (client.host, client.port, client.db) == ("cache.internal", 6380, 3)


@pytest.mark.parametrize("shape", [
    "redis://:{pw}@h:notaport/0", "redis://:{pw}@h:6379/x", "redis://:{pw}@h/0?colour=1",
    "redis://:{pw}@h1:1,h2:2/0", "rediz://:{pw}@h/0", "redis:/:{pw}@h/0", ":{pw}@h:6379",
    "memcached://:{pw}@h:11211", "redis+cluster://:{pw}@", "redis://:{pw}@h/0?timeout=soon",
    "redis://:{pw}@h/0?ssl_ca_certs=/nope.pem",
])
def test_invalid_urls_name_the_mistake_never_the_password(password: str, shape: str) -> None:
    with pytest.raises(ac.ConfigError) as info:
        ac.connect(shape.format(pw=password))
    assert_clean(str(info.value) + repr(info.value), password)


def test_a_server_is_reached_with_a_raw_password_and_logs_stay_clean(
        acl_redis: servers.RedisServer, password: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="asynccache")
    url = f"redis://{user_of(password)}:{password}@127.0.0.1:{acl_redis.port}/0"

    async def roundtrip() -> Any:
        async with ac.AsyncKVCache(ac.connect(url), namespace="raw-password") as cache:
            await cache.set("k", "v")
            return await cache.get("k")

    assert asyncio.run(roundtrip()) == "v"
    wrong = f"redis://{user_of(password)}:{password}x@127.0.0.1:{acl_redis.port}/0"
    dp = ac.AsyncKVCacheMapDataPipe(list(range(8)), ac.connect(wrong), namespace="wrong-pw")
    assert [dp[i] for i in range(8)] == list(range(8))  # refused: misses, logged
    assert dp.stats()["errors"] >= 1
    dp.close()
    assert caplog.records
    assert_clean("\n".join(r.getMessage() for r in caplog.records), password)


# -- the command line ----------------------------------------------------------------------
def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("command", [
    ["ping", "redis://:{pw}@127.0.0.1:notaport/0"],
    ["ping", "redis://:{pw}@127.0.0.1:{port}/0", "--timeout", "0.3", "--json"],
    ["ping", "redis://:{pw}@127.0.0.1:{port}/0", "unexpected"],
    ["stats", "redis://:{pw}@127.0.0.1:1/x", "--namespace", "ns"],
    ["stats", "redis://:{pw}@127.0.0.1:{port}/0", "--namespace", "ns", "--timeout", "0.3"],
    ["flush", "redis://:{pw}@127.0.0.1:{port}/0?colour=blue", "--namespace", "ns"],
    ["flush", "redis://:{pw}@127.0.0.1:{port}/0", "--namespace", "ns", "--yes",
     "--timeout", "0.3"],
    ["warm", "redis://:{pw}@127.0.0.1:{port}/0", "--namespace", "ns"],  # no --dataset
    ["warm", "redis://:{pw}@h1:1,h2:2/0", "--namespace", "ns", "--dataset", "m:a"],
    ["warm", "redis://:{pw}@127.0.0.1:{port}/0", "--namespace", "ns", "--dataset",
     "no_such_module_here:data", "--timeout", "0.3"],
])
def test_command_line_output_never_shows_the_password(
        password: str, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    port = servers.free_port()  # nobody listens: the commands that connect fail
    args = [part.format(pw=password, port=port) for part in command]
    code, output = run(capsys, *args)
    assert code in (1, 2), output
    assert "error" in output
    assert_clean(output, password)


#: credentials typed after the slashes (issue 30): each was refused or accepted with the
#: password in the message or the repr
TYPOS = ["redis:///:{pw}@h", "rediss:///user:{pw}@h", "redis+cluster:///:{pw}@h:1",
         "lmdb://:{pw}@/tmp/asynccache-typo", "unix:///:{pw}@/run/redis.sock",
         "memcached:///:{pw}@h", "valkey:///:{pw}@h"]


@pytest.mark.parametrize("typo", TYPOS)
def test_a_url_with_the_credentials_after_the_slashes_never_shows_them(
        typo: str, capsys: pytest.CaptureFixture[str]) -> None:
    secret = password_with(":")
    url = typo.format(pw=secret)
    with pytest.raises(ac.InvalidURL) as info:
        ac.connect(url)
    assert not any(word in str(info.value) for word in WORDS), str(info.value)
    assert "***" in str(info.value)
    with pytest.raises(SystemExit) as exited:  # argparse: a usage error, one line, masked
        main(["ping", url])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err and not any(word in err for word in WORDS), err
