"""A loopback TCP proxy that injects faults: latency, a trickle, a black hole, refusals, resets.

Tests and benchmarks put it between a client and a local store to see what the client
does when the network is slow or broken, without root, ``tc`` or iptables.

The proxy runs its own event loop in a daemon thread, so synchronous tests and asyncio
tests (whose loop must not be blocked) can both use it. Control methods are thread-safe:
they run on the proxy's loop and return once the change is in effect.

Latency is added per chunk, not per connection: each chunk read is queued with a due
time (arrival + rtt/2) and written by a per-direction writer task when due. Reading
never waits for the delay, so pipelined requests overlap exactly as they would on a real
slow link (100 pipelined requests at 1 ms RTT take ~1 ms, not 100 ms), and one writer
per direction keeps the byte order.

A trickle (``set_trickle(nbytes, every)``) models a link so slow that a large reply
arrives in pieces: the writer forwards at most ``nbytes`` per window of ``every``
seconds, in the chosen direction(s). Due bytes from several chunks are coalesced into
one piece, a larger chunk is split, and bytes that arrive later in a window use what is
left of its budget, so the rate is the configured one whatever sizes the reads return.
It sits after the latency stage (a byte is first due, then waits for its piece), so the
two compose. Changing or lifting the trickle wakes a writer that is pausing between
pieces: the new setting governs every byte not yet forwarded as soon as the call returns.
It reproduces what a per-read socket timeout cannot catch: every read gets data within
the timeout, the whole reply takes far longer.

It only ever listens on and connects to loopback addresses: it is a test tool, and
must never become an open relay.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import math
import socket
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["FaultProxy", "url_through"]

_CHUNK = 65536
_QUEUE_CHUNKS = 256  # per direction; bounds memory when the far side is slow
_CONTROL_TIMEOUT = 10.0
_DIRECTIONS = ("down", "up", "both")


def _require_loopback(host: str, what: str) -> None:
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"{what}={host!r} is not a loopback address: FaultProxy only listens on and "
            "connects to 127.0.0.0/8, ::1 or 'localhost'"
        )


def _set_rst_on_close(writer: asyncio.StreamWriter) -> None:
    """SO_LINGER with a zero timeout: close() then sends RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _Direction:
    """One direction of a link: chunks wait in a FIFO until due, one writer sends them.

    With no latency, no trickle and nothing queued, a chunk is written straight away by
    the reader (saves a task switch per chunk); otherwise it goes through the queue, so
    the order is kept however the latency or the trickle changes.
    """

    def __init__(self, proxy: FaultProxy, writer: asyncio.StreamWriter, name: str) -> None:
        self.proxy = proxy
        self.writer = writer
        self.name = name  # "up" (client -> server) or "down"
        self.counter = f"bytes_{name}"
        self.queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(_QUEUE_CHUNKS)
        self.busy = False  # the writer holds bytes it has taken off the queue

    async def read_from(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(_CHUNK):
                delay = self.proxy._delay
                direct = delay == 0 and self.proxy._trickle_for(self.name) is None
                if direct and not self.busy and self.queue.empty():
                    await self._send(data)
                else:
                    await self.queue.put((loop.time() + delay, data))
        except OSError:
            pass
        await self.queue.put(None)

    async def write_queued(self) -> None:
        loop = asyncio.get_running_loop()
        pending = bytearray()  # due bytes the trickle has not let through yet
        held: tuple[float, bytes] | None = None  # taken off the queue to coalesce, not due
        ended = False  # the reader's end mark has been taken off the queue
        # The trickle lets through at most nbytes per window of `every` seconds. A budget,
        # not one piece per window: a reply that arrives in several reads still gets
        # its whole nbytes at once, however the server's bytes were split.
        window_end = -math.inf
        budget = 0  # bytes the current window may still forward
        window_setting: tuple[int, float] | None = None  # the setting it was opened for
        try:
            while True:
                if not pending:
                    item = held if held is not None or ended else await self.queue.get()
                    held = None
                    if item is None:
                        return
                    self.busy = True
                    due, data = item
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if self.proxy._trickle_for(self.name) is None:
                        await self._send(data)
                        self.busy = False
                        continue
                    pending += data
                trickle = self.proxy._trickle_for(self.name)
                if trickle is None:  # lifted while bytes were held back: send them now
                    data = bytes(pending)
                    pending.clear()
                    await self._send(data)
                    self.busy = held is not None
                    continue
                nbytes, every = trickle
                while len(pending) < nbytes and held is None and not ended:
                    try:
                        item = self.queue.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    if item is None:
                        ended = True
                    elif item[0] <= loop.time():
                        pending += item[1]
                    else:
                        held = item
                now = loop.time()
                if trickle != window_setting or now >= window_end:
                    window_setting, window_end, budget = trickle, now + every, nbytes
                if budget <= 0:
                    await self._pause(window_end - now)
                    continue  # the setting may have changed, more bytes may be due
                piece = bytes(pending[:budget])
                del pending[:budget]
                budget -= len(piece)
                await self._send(piece)
                self.busy = bool(pending) or held is not None
        except OSError:
            pass

    async def _pause(self, seconds: float) -> None:
        """Sleep between trickle pieces; a change of the trickle setting ends it early."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.proxy._trickle_changed.wait(), seconds)

    async def _send(self, data: bytes) -> None:
        if self.proxy._blackhole:
            return
        self.writer.write(data)
        self.proxy._stats[self.counter] += len(data)
        await self.writer.drain()


class _Link:
    """One client connection and its upstream connection, with a pump each way."""

    def __init__(
        self, proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.proxy = proxy
        self.client_reader = reader
        self.client_writer = writer
        self.upstream_writer: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self._closed: asyncio.Future[None] | None = None

    async def run(self) -> None:
        proxy = self.proxy
        try:
            up_reader, up_writer = await asyncio.open_connection(
                proxy.target_host, proxy.target_port
            )
        except OSError:
            # Nobody at the target (server killed): the client sees a reset, like a refusal.
            proxy._stats["reset"] += 1
            await self.close(rst=True)
            return
        self.upstream_writer = up_writer
        if self._closed is not None:  # reset or shut down while we were connecting
            up_writer.transport.abort()
            await self._closed
            return
        up = _Direction(proxy, up_writer, "up")
        down = _Direction(proxy, self.client_writer, "down")
        self.tasks = [
            asyncio.create_task(up.read_from(self.client_reader)),
            asyncio.create_task(down.read_from(up_reader)),
        ]
        writers = [asyncio.create_task(up.write_queued()), asyncio.create_task(down.write_queued())]
        self.tasks += writers
        # Either side closing (after what it sent has been forwarded) ends the link.
        await asyncio.wait(writers, return_when=asyncio.FIRST_COMPLETED)
        await self.close(rst=False)

    def close(self, *, rst: bool) -> asyncio.Future[None]:
        """Close both sides (once); with *rst*, the client gets a TCP reset, not a FIN."""
        if self._closed is None:
            self._closed = asyncio.ensure_future(self._close(rst))
        return self._closed

    async def _close(self, rst: bool) -> None:
        for task in self.tasks:
            task.cancel()
        if rst:
            _set_rst_on_close(self.client_writer)
            self.client_writer.transport.abort()
        else:
            self.client_writer.close()
        if self.upstream_writer is not None:
            self.upstream_writer.transport.abort()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in (self.client_writer, self.upstream_writer):
            if writer is not None:
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        self.proxy._links.discard(self)


class FaultProxy:
    """Forward ``listen_host:listen_port`` to ``target_host:target_port`` with faults.

    Args:
        target_host: the server's host (loopback only).
        target_port: the server's port.
        listen_host: where the proxy listens (loopback only).
        listen_port: its port (0: a free one, kept across a stop and a later start).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        _require_loopback(target_host, "target_host")
        _require_loopback(listen_host, "listen_host")
        self.target_host = target_host
        self.target_port = target_port
        self.host = listen_host
        self.port = listen_port  # the real port once started (kept for a later start())
        self._delay = 0.0
        self._trickle: tuple[int, float, str] | None = None  # nbytes, every, direction
        # Set (and replaced) on every trickle change, to wake writers pausing between pieces.
        self._trickle_changed = asyncio.Event()
        self._blackhole = False
        self._refuse = False
        self._stats = {"accepted": 0, "reset": 0, "bytes_up": 0, "bytes_down": 0}
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None

    # -- lifecycle
    def start(self) -> Self:
        """Start listening (idempotent); returns once the port is bound."""
        with self._lock:
            if self._thread is not None:
                return self
            loop = asyncio.new_event_loop()
            ready: concurrent.futures.Future[None] = concurrent.futures.Future()
            thread = threading.Thread(
                target=self._run,
                args=(loop, ready),
                name=f"FaultProxy->{self.target_host}:{self.target_port}",
                daemon=True,
            )
            thread.start()
            try:
                ready.result(_CONTROL_TIMEOUT)
            except BaseException:
                thread.join(_CONTROL_TIMEOUT)
                raise
            self._loop, self._thread = loop, thread
        return self

    def stop(self) -> None:
        """Close the listener and every connection, end the thread. Idempotent."""
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None:
                return
            if threading.current_thread() is thread:
                raise RuntimeError("FaultProxy.stop() cannot be called from the proxy's loop")
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(_CONTROL_TIMEOUT)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(_CONTROL_TIMEOUT)
                self._loop = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        trickle = "off"
        if self._trickle is not None:
            nbytes, every, direction = self._trickle
            trickle = f"{nbytes}B/{every:g}s {direction}"
        return (
            f"<FaultProxy {self.host}:{self.port} -> {self.target_host}:{self.target_port}"
            f" delay={self._delay * 2:g}s trickle={trickle} blackhole={self._blackhole}"
            f" refuse={self._refuse}>"
        )

    # -- faults
    def set_latency(self, rtt_seconds: float) -> None:
        """Add ``rtt_seconds / 2`` to each direction (applies to data read from now on).

        Args:
            rtt_seconds: the round trip time added, in seconds.
        """
        if rtt_seconds < 0:
            raise ValueError(f"rtt_seconds must be >= 0, not {rtt_seconds}")
        self._control(lambda: setattr(self, "_delay", rtt_seconds / 2))

    def set_trickle(self, nbytes: int | None, every: float = 0.0, direction: str = "down") -> None:
        """Forward at most ``nbytes`` per ``every`` seconds in ``direction``.

        One setting: each call replaces the previous one, so ``set_trickle(0)`` lifts
        the trickle in both directions. Bytes already held back are sent at the new rate
        (or at once when lifted) as soon as this returns.

        Args:
            nbytes: bytes per period; 0 or None: off.
            every: the period, in seconds.
            direction: "down" (server -> client), "up" (client -> server) or "both".
        """
        if direction not in _DIRECTIONS:
            raise ValueError(f"direction must be one of {_DIRECTIONS}, not {direction!r}")
        if not nbytes:
            setting = None
        elif nbytes < 0 or not every > 0:
            raise ValueError(
                f"a trickle needs nbytes > 0 and every > 0 seconds, not {nbytes}, {every}"
            )
        else:
            setting = (int(nbytes), float(every), direction)

        def change() -> None:
            self._trickle = setting
            self._trickle_changed.set()
            self._trickle_changed = asyncio.Event()

        self._control(change)

    def set_blackhole(self, on: bool) -> None:
        """Keep accepting and reading, forward nothing either way (clients hang)."""
        self._control(lambda: setattr(self, "_blackhole", bool(on)))

    def set_refuse(self, on: bool) -> None:
        """Accept new connections and reset them at once (open ones are left alone)."""
        self._control(lambda: setattr(self, "_refuse", bool(on)))

    def reset_all(self) -> None:
        """Send a TCP reset on every open client connection; returns once they are closed."""
        loop = self._running_loop()
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self._reset_all(), loop).result(_CONTROL_TIMEOUT)

    @property
    def connections(self) -> int:
        """Client connections open right now."""
        return len(self._links)

    @property
    def stats(self) -> dict[str, int]:
        """A copy of the counters: accepted, reset, bytes_up, bytes_down (bytes forwarded)."""
        return dict(self._stats)

    # -- loop side
    def _run(self, loop: asyncio.AbstractEventLoop, ready: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(loop)
        # An Event binds to the loop that first waits on it: a restarted proxy needs a new one.
        self._trickle_changed = asyncio.Event()
        try:
            server = loop.run_until_complete(
                asyncio.start_server(self._on_client, self.host, self.port)
            )
        except BaseException as exc:
            loop.close()
            ready.set_exception(exc)
            return
        self._server = server
        self.port = server.sockets[0].getsockname()[1]
        ready.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def _trickle_for(self, direction: str) -> tuple[int, float] | None:
        """``(nbytes, every)`` if data going *direction* ("up"/"down") trickles."""
        setting = self._trickle
        if setting is None or setting[2] not in (direction, "both"):
            return None
        return setting[0], setting[1]

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._stats["accepted"] += 1
        link = _Link(self, reader, writer)
        if self._refuse:
            self._stats["reset"] += 1
            await link.close(rst=True)
            return
        self._links.add(link)
        await link.run()

    async def _reset_all(self) -> None:
        links = list(self._links)
        self._stats["reset"] += len(links)
        await asyncio.gather(*(link.close(rst=True) for link in links))

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await asyncio.gather(*(link.close(rst=False) for link in list(self._links)))
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _control(self, change: Callable[[], None]) -> None:
        """Run *change* on the proxy loop and wait, so it is in effect on return."""
        loop = self._running_loop()
        if loop is None:
            change()  # not running: there is no loop to race with
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            try:
                change()
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        loop.call_soon_threadsafe(run)
        done.result(_CONTROL_TIMEOUT)

    def _running_loop(self) -> asyncio.AbstractEventLoop | None:
        if threading.current_thread() is self._thread:
            raise RuntimeError("FaultProxy control methods block: call them from another thread")
        return self._loop


def url_through(proxy: FaultProxy, server_url: str) -> str:
    """Rewrite a single-host store URL to go through *proxy* (scheme, auth, db kept).

    ``redis://:pw@127.0.0.1:6379/0`` -> ``redis://:pw@127.0.0.1:<proxy.port>/0``.
    Cluster URLs cannot be proxied this way (MOVED replies name the real nodes), nor
    unix sockets (the proxy is TCP).
    """
    parts = urlsplit(server_url)
    if parts.scheme not in ("redis", "rediss", "memcached") or "," in parts.netloc:
        raise ValueError(
            f"url_through() needs a single-host redis:// or memcached:// URL, not {server_url!r}"
        )
    if not proxy.port:
        raise ValueError("start the proxy before asking for a URL through it")
    userinfo, _, _ = parts.netloc.rpartition("@")
    host = f"[{proxy.host}]" if ":" in proxy.host else proxy.host
    netloc = f"{userinfo}@" if userinfo else ""
    return urlunsplit(parts._replace(netloc=f"{netloc}{host}:{proxy.port}"))
