"""A garbled Redis reply is a counted store failure, never an exception in a read nor a
value paired with the wrong key (issue 30): an MGET array one element too long, error
elements inside the array (as some fan-out proxies send).

No real server sends these, so the server here is a script: it speaks enough RESP for the
client (commands are arrays of bulk strings; SET and anything else get +OK) and answers
every MGET in the chosen garbled way.
"""

from __future__ import annotations

import asyncio
import socket
import socketserver
import threading
from collections.abc import Iterator

import hiredis
import pytest

import asynccache as ac
from asynccache.store.protocol.resp import check_mget_reply

N = 64


def test_the_check_refuses_what_is_not_one_value_or_nil_per_key() -> None:
    assert check_mget_reply([b"a", None, b"c"], "h", 3) == [b"a", None, b"c"]
    assert check_mget_reply([memoryview(b"a"), bytearray(b"b")], "h", 2)  # the bulk reader's
    with pytest.raises(ac.StoreError, match="4 elements for 3 keys"):
        check_mget_reply([None] * 4, "h", 3)
    with pytest.raises(ac.StoreError, match="2 elements for 3 keys"):
        check_mget_reply([None] * 2, "h", 3)
    with pytest.raises(ac.StoreError, match="ReplyError: 'ERR proxy"):
        check_mget_reply([b"a", hiredis.ReplyError("ERR proxy: backend down"), None], "h", 3)
    with pytest.raises(ac.StoreError, match="an element that is a int"):
        check_mget_reply([b"a", 7, None], "h", 3)
    with pytest.raises(ac.StoreError, match="answered MGET with an error"):
        check_mget_reply(hiredis.ReplyError("ERR nope"), "h", 3)


class _Garbling(socketserver.StreamRequestHandler):
    mode = "extra"

    def handle(self) -> None:
        while True:
            head = self.rfile.readline()
            if not head:
                return
            args = [self.rfile.read(int(self.rfile.readline()[1:])) + self.rfile.read(2)
                    for _ in range(int(head[1:]))]
            name = args[0][:-2].upper()
            if name != b"MGET":
                self.wfile.write(b"+OK\r\n")
                continue
            keys = len(args) - 1
            if self.server.mode == "extra":  # type: ignore[attr-defined]
                reply = b"*%d\r\n" % (keys + 1) + b"$-1\r\n" * (keys + 1)
            else:
                reply = b"*%d\r\n" % keys + b"-ERR proxy: backend down\r\n" * keys
            self.wfile.write(reply)


@pytest.fixture(params=["extra", "errors"])
def garbling_url(request: pytest.FixtureRequest) -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Garbling)
    server.daemon_threads = True
    server.mode = request.param  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{server.server_address[1]}/0"
    finally:
        server.shutdown()
        server.server_close()


def test_the_pipe_reads_right_values_through_a_garbling_server(garbling_url: str,
                                                               namespace: str) -> None:
    source = [i * 3 for i in range(N)]
    with ac.AsyncKVCacheMapDataPipe(source, ac.connect(garbling_url, timeout=2),
                                    namespace=namespace) as dp:
        assert [dp[i] for i in range(N)] == source  # read-ahead on the consumer's socket
        assert dp.__getitems__(list(range(N))) == source  # a batch through the loop
        stats = dp.stats()
    assert stats["errors"] > 0 and stats["hits"] == 0, stats  # counted, nothing wrong read


def test_get_many_of_the_core_finds_misses_through_a_garbling_server(garbling_url: str,
                                                                     namespace: str) -> None:
    async def run() -> tuple[dict[object, object], dict[str, int]]:
        async with ac.AsyncKVCache(ac.connect(garbling_url, timeout=2),
                                   namespace=namespace) as cache:
            return await cache.get_many(list(range(10))), cache.stats()

    found, stats = asyncio.run(run())
    assert found == {} and stats["errors"] > 0


def test_the_scripted_server_is_what_the_client_talks_to(garbling_url: str) -> None:
    """The script answers as intended (else the tests above would prove nothing)."""
    port = int(garbling_url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"*3\r\n$4\r\nMGET\r\n$1\r\na\r\n$1\r\nb\r\n")
        reader = hiredis.Reader()
        reply = False
        while reply is False:
            reader.feed(sock.recv(65536))
            reply = reader.gets()
    assert isinstance(reply, list)
    assert len(reply) == 3 or any(isinstance(v, hiredis.ReplyError) for v in reply)
