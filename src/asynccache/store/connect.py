"""``connect(url, **options)``: turn a store URL into a client configuration object.

The accepted forms: `connect()`; why it is built this way: docs/design.md, "URLs".
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, unquote

from ..errors import CacheError, ConfigError, InvalidURL
from . import registry
from .api import BaseClient
from .credentials import mask_url, split_userinfo
from .memcached.client import MemcachedClient
from .memory import MemoryClient
from .redis.client import RedisClient
from .transport.tls import TlsSettings
from .url_options import flag

__all__ = ["connect"]

ACCEPTED = (
    "redis://host:port/db, rediss://host:port/db, unix:///path/to/redis.sock, "
    "redis+cluster://host:port,host:port, rediss+cluster://host:port,host:port, "
    "memcached://host:port[,host:port], memory://, lmdb:///path/to/dir "
    "(valkey://, valkeys://, valkey+cluster://, valkeys+cluster:// as the redis ones)"
)
#: Valkey speaks Redis's protocol: its URLs name the same clients
_VALKEY = {"valkey": "redis", "valkeys": "rediss", "valkey+cluster": "redis+cluster",
           "valkeys+cluster": "rediss+cluster"}
_FLOAT_OPTIONS = {"timeout", "connect_timeout"}
_INT_OPTIONS = {"max_batch", "item_size", "db"}
_BOOL_OPTIONS = {"tls", "ssl_check_hostname"}
_TLS_FILES = {"ssl_ca_certs": "ca_certs", "ssl_certfile": "certfile", "ssl_keyfile": "keyfile"}
_TLS_OPTIONS = {*_TLS_FILES, "ssl_cert_reqs", "ssl_check_hostname"}
_STR_OPTIONS = {*_TLS_FILES, "ssl_cert_reqs", "password_env"}
_ALL_OPTIONS = _FLOAT_OPTIONS | _INT_OPTIONS | _BOOL_OPTIONS | _STR_OPTIONS


def _mask(url: str) -> str:
    """The URL with its password replaced, for error messages (found as
    `_connect()` finds it: any character may be in a password)."""
    return mask_url(url)


def _options(query: str, url: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, raw in parse_qsl(query, keep_blank_values=True):
        try:
            if name in _FLOAT_OPTIONS:
                options[name] = float(raw)
            elif name in _INT_OPTIONS:
                options[name] = int(raw)
            elif name in _BOOL_OPTIONS:
                options[name] = _flag(name, raw, url)
            elif name in _STR_OPTIONS:
                options[name] = raw
            else:
                raise InvalidURL(
                    f"unknown option {name!r} in {_mask(url)}; known options: "
                    f"{', '.join(sorted(_ALL_OPTIONS))}"
                )
        except ValueError as exc:
            if isinstance(exc, InvalidURL):
                raise
            raise InvalidURL(f"option {name}={raw!r} in {_mask(url)} is not a number") from exc
    return options


def _flag(name: str, raw: Any, url: str) -> bool:
    return flag(name, raw, _mask(url))


def _tls(enabled: bool, opts: dict[str, Any], url: str) -> TlsSettings | None:
    """The TLS settings the URL and options ask for (their files checked), or None; the
    TLS options are taken out of ``opts``."""
    tls_flag = opts.pop("tls", None)
    if tls_flag is not None:
        tls_flag = _flag("tls", tls_flag, url)
        if enabled and not tls_flag:
            raise InvalidURL(f"{_mask(url)}: tls=false contradicts the TLS scheme")
        enabled = tls_flag
    given = {name: opts.pop(name) for name in _TLS_OPTIONS if name in opts}
    if not enabled:
        if given:
            raise ConfigError(
                f"{', '.join(sorted(given))} given for {_mask(url)}, which does not use TLS "
                "(it would connect in the clear): use rediss:// or rediss+cluster://, or "
                "add tls=true"
            )
        return None
    files = {}
    for option, attr in _TLS_FILES.items():
        if given.get(option) is not None:
            files[attr] = os.fspath(given[option])
    tls = TlsSettings(
        **files,
        cert_reqs=str(given.get("ssl_cert_reqs", "required")).lower(),
        check_hostname=_flag("ssl_check_hostname", given.get("ssl_check_hostname", True), url),
    )
    tls.check()
    return tls


def _host_port(item: str, default_port: int, url: str) -> tuple[str, int]:
    host, sep, port_text = item.strip().rpartition(":")
    if not sep:
        host, port_text = item.strip(), str(default_port)
    host = host.strip("[]")
    if not host:
        raise InvalidURL(f"missing host in {item!r} of {_mask(url)}; expected host:port")
    try:
        port = int(port_text)
    except ValueError:
        raise InvalidURL(
            f"bad port {port_text!r} in {_mask(url)}; a port is a number from 1 to 65535"
        ) from None
    if not 0 < port < 65536:
        raise InvalidURL(f"bad port {port} in {_mask(url)}; a port is a number from 1 to 65535")
    return host, port


def _credentials(userinfo: str | None) -> tuple[str | None, str | None]:
    """(username, password) from ``user:password`` (each percent-decoded)."""
    if userinfo is None:
        return None, None
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None, unquote(password) if colon else None)


def connect(
    url: str,
    *,
    timeout: float | None = None,
    connect_timeout: float | None = None,
    max_batch: int | None = None,
    item_size: int | None = None,
    tls: bool | None = None,
    ssl_ca_certs: str | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    ssl_cert_reqs: str | None = None,
    ssl_check_hostname: bool | None = None,
    password_env: str | None = None,
    **options: Any,
) -> BaseClient[Any]:
    """Build a client for ``url``: picklable configuration, no network I/O (connections
    open lazily, in the process and event loop that first uses them).

    The accepted forms:

    ```text
    redis://[user:password@]host[:port][/db][?option=value...]     (port 6379, db 0)
    rediss://...                                                   (TLS)
    unix://[user:password@]/path/to/redis.sock[?db=N&option=value]
    redis+cluster://[user:password@]host:port[,host:port...]
    rediss+cluster://...                                           (TLS to every node)
    valkey://, valkeys://, valkey+cluster://, valkeys+cluster://   (the same as redis)
    memcached://host[:port][,host[:port]...][?option=value]        (port 11211)
    memory://[name]
    lmdb:///path/to/dir[?map_size=64GiB&option=value]              (one machine, no server)
    scheme://...                                                   (a registered provider)
    ```

    Args:
        url: the store, in one of the forms above. Every keyword below may also be a
            query parameter (``?timeout=0.5``); a keyword given here wins. None: the
            URL's value, else the store's default.
        timeout: seconds that bound every operation end to end (default 1).
        connect_timeout: seconds to open a connection (default: ``timeout``).
        max_batch: keys per multi-get request.
        item_size: the store's largest value in bytes (memcached ``-I``); larger values
            are chunked.
        tls: TLS on a plain scheme (``rediss://`` says it already).
        ssl_ca_certs: a CA bundle that verifies the server.
        ssl_certfile: the client certificate (mutual TLS).
        ssl_keyfile: the client certificate's key.
        ssl_cert_reqs: ``"required"`` (default) or ``"none"`` (no verification).
        ssl_check_hostname: check the certificate's host name (default True).
        password_env: the name of an environment variable holding the password, so that
            it appears in no URL, command line or pickle.
        **options: what a registered provider's scheme or ``lmdb://`` takes besides
            (e.g. ``map_size``). See the docs' "Stores and URLs" and "Security" pages.

    Raises:
        InvalidURL: the URL has none of these forms, or a bad host, port or option.
        ConfigError: an option the store does not take.
    """
    named = {"timeout": timeout, "connect_timeout": connect_timeout, "max_batch": max_batch,
             "item_size": item_size, "tls": tls, "ssl_ca_certs": ssl_ca_certs,
             "ssl_certfile": ssl_certfile, "ssl_keyfile": ssl_keyfile,
             "ssl_cert_reqs": ssl_cert_reqs, "ssl_check_hostname": ssl_check_hostname,
             "password_env": password_env}
    given = {name: value for name, value in named.items() if value is not None}
    try:
        return _connect(url, {**given, **options})
    except TypeError as exc:  # an unknown keyword option
        raise ConfigError(
            f"connect({_mask(url)!r}): {exc}; options are "
            f"{', '.join(sorted(_ALL_OPTIONS - {'db'}))} (password_env and the ssl_* "
            "options where the store has them)"
        ) from None


def _connect(url: str, options: dict[str, Any]) -> BaseClient[Any]:
    if not isinstance(url, str) or "://" not in url:
        raise InvalidURL(f"not a store URL: {_mask(url)!r}; accepted forms: {ACCEPTED}")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    factory = registry.lookup(scheme)
    if factory is not None:
        return _from_factory(scheme, factory, url, options)
    scheme = _VALKEY.get(scheme, scheme)
    if scheme == "lmdb":
        from .lmdb.client import LmdbClient  # imports the lmdb package: only when asked

        return LmdbClient.from_url(url, **options)
    # the credentials first, up to the last "@": a password may hold "/", "?", "#", "@"
    userinfo, rest = split_userinfo(rest)
    user, password = _credentials(userinfo)
    hosts, _, query = rest.partition("?")
    hosts, _, path = hosts.partition("/")
    opts = {**_options(query, url), **options}

    if scheme in ("redis", "rediss"):
        tls = _tls(scheme == "rediss", opts, url)
        if "," in hosts:
            raise InvalidURL(
                f"{_mask(url)} names several hosts; use redis+cluster:// for a Redis Cluster"
            )
        host, port = _host_port(hosts, 6379, url)
        db = opts.pop("db", None)
        if path:
            try:
                db = int(path.strip("/"))
            except ValueError:
                raise InvalidURL(
                    f"bad database {path!r} in {_mask(url)}; the path is a db number, e.g. /0"
                ) from None
        return RedisClient(host=host, port=port, db=db or 0, username=user, password=password,
                           tls=tls, **opts)
    if scheme == "unix":
        if hosts:
            raise InvalidURL(f"{_mask(url)}: a unix URL has no host; write unix:///path/to.sock")
        if not path:
            raise InvalidURL(f"{_mask(url)}: missing socket path; write unix:///path/to.sock")
        if "@" in path:  # unix:///:password@/path: credentials typed after the slashes
            raise InvalidURL(f"{_mask(url)}: the user and password of a unix URL come before "
                             "the path: unix://user:password@/path/to.sock")
        db = opts.pop("db", 0)
        return RedisClient(unix_socket_path="/" + path, db=db, username=user, password=password,
                           tls=_tls(False, opts, url), **opts)
    if scheme in ("redis+cluster", "rediss+cluster"):
        tls = _tls(scheme == "rediss+cluster", opts, url)
        nodes = [_host_port(h, 6379, url) for h in hosts.split(",") if h.strip()]
        if not nodes:
            raise InvalidURL(f"{_mask(url)} names no cluster node; write redis+cluster://h:p,h:p")
        from .redis.cluster import RedisClusterClient  # redis-py: only when asked for

        return RedisClusterClient(nodes=nodes, username=user, password=password, tls=tls,
                                  **opts)
    if scheme in ("memcached", "memory") and userinfo is not None:
        raise InvalidURL(f"{_mask(url)}: {scheme}:// takes no user name or password")
    if scheme == "memcached":
        tls = _tls(False, opts, url)
        servers = [_host_port(h, 11211, url) for h in hosts.split(",") if h.strip()]
        if not servers:
            raise InvalidURL(f"{_mask(url)} names no server; write memcached://host:port")
        return MemcachedClient(servers=servers, tls=tls, **opts)
    if scheme == "memory":
        return MemoryClient(name=hosts or "default", **opts)
    others = [name for name in registry.known_schemes() if name not in registry.BUILTIN_SCHEMES]
    registered = (f"; registered by providers: {', '.join(others)}" if others else
                  "; no provider registered another scheme (asynccache.register_scheme, or "
                  f"an {registry.ENTRY_POINT_GROUP!r} entry point)")
    raise InvalidURL(f"unknown scheme {scheme!r} in {_mask(url)}; accepted forms: "
                     f"{ACCEPTED}{registered}")


def _from_factory(scheme: str, factory: registry.Factory, url: str,
                  options: dict[str, Any]) -> BaseClient[Any]:
    """A registered provider's client, checked: its mistakes are ConfigErrors naming it."""
    try:
        client = factory(url, **options)
    except CacheError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"connect({_mask(url)!r}): the factory registered for {scheme!r} "
            f"({registry.describe(factory)}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(client, BaseClient):
        raise ConfigError(
            f"the factory registered for {scheme!r} ({registry.describe(factory)}) returned "
            f"a {type(client).__name__}, not a client: it must return an asynccache.Provider "
            "(or BaseClient) instance")
    return client
