"""``connect(url, **options)``: turn a store URL into a client configuration object.

Accepted forms::

    redis://[user:password@]host[:port][/db][?option=value...]     (port 6379, db 0)
    rediss://...                                                   (TLS)
    unix://[user:password@]/path/to/redis.sock[?db=N&option=value]
    redis+cluster://[user:password@]host:port[,host:port...]
    memcached://host[:port][,host[:port]...][?option=value]        (port 11211)
    memory://[name]

Options (query string or keyword, keywords win): ``timeout`` and ``connect_timeout``
(seconds), ``max_batch`` (keys per multi-get) and ``item_size`` (bytes: memcached's
``-I``, Redis' ``proto-max-bulk-len``; larger values are chunked).
No network I/O happens here: connections open lazily on first use.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .clients import BaseClient, MemcachedClient, MemoryClient, RedisClient, RedisClusterClient
from .errors import ConfigError, InvalidURL

__all__ = ["connect"]

ACCEPTED = (
    "redis://host:port/db, rediss://host:port/db, unix:///path/to/redis.sock, "
    "redis+cluster://host:port,host:port, memcached://host:port[,host:port], memory://"
)
_FLOAT_OPTIONS = {"timeout", "connect_timeout"}
_INT_OPTIONS = {"max_batch", "item_size", "db"}


def _mask(url: str) -> str:
    """The URL with its password replaced, for error messages."""
    parts = urlsplit(url) if "://" in url else None
    if parts is None or parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def _options(query: str, url: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, raw in parse_qsl(query, keep_blank_values=True):
        try:
            if name in _FLOAT_OPTIONS:
                options[name] = float(raw)
            elif name in _INT_OPTIONS:
                options[name] = int(raw)
            else:
                raise InvalidURL(
                    f"unknown option {name!r} in {_mask(url)}; known options: "
                    f"{', '.join(sorted(_FLOAT_OPTIONS | _INT_OPTIONS))}"
                )
        except ValueError as exc:
            if isinstance(exc, InvalidURL):
                raise
            raise InvalidURL(f"option {name}={raw!r} in {_mask(url)} is not a number") from exc
    return options


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


def _split_netloc(netloc: str) -> tuple[str | None, str | None, str]:
    """(username, password, hosts) from ``user:pass@hosts``; the hosts part may be a list."""
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return None, None, netloc
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None, unquote(password) if colon else None, hosts)


def connect(url: str, **options: Any) -> BaseClient[Any]:
    """Build a client for ``url``; see the module docstring for the accepted forms."""
    try:
        return _connect(url, options)
    except TypeError as exc:  # an unknown keyword option
        raise ConfigError(
            f"connect({_mask(url)!r}): {exc}; options are timeout, connect_timeout, "
            "max_batch and item_size"
        ) from None


def _connect(url: str, options: dict[str, Any]) -> BaseClient[Any]:
    if not isinstance(url, str) or "://" not in url:
        raise InvalidURL(f"not a store URL: {url!r}; accepted forms: {ACCEPTED}")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    netloc, _, query = rest.partition("?")
    netloc, _, path = netloc.partition("/")
    opts = {**_options(query, url), **options}

    if scheme in ("redis", "rediss"):
        user, password, hosts = _split_netloc(netloc)
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
                           ssl=scheme == "rediss", **opts)
    if scheme == "unix":
        user, password, hosts = _split_netloc(netloc)
        if hosts:
            raise InvalidURL(f"{_mask(url)}: a unix URL has no host; write unix:///path/to.sock")
        if not path:
            raise InvalidURL(f"{_mask(url)}: missing socket path; write unix:///path/to.sock")
        db = opts.pop("db", 0)
        return RedisClient(unix_socket_path="/" + path, db=db, username=user, password=password,
                           **opts)
    if scheme == "redis+cluster":
        user, password, hosts = _split_netloc(netloc)
        nodes = [_host_port(h, 6379, url) for h in hosts.split(",") if h.strip()]
        if not nodes:
            raise InvalidURL(f"{_mask(url)} names no cluster node; write redis+cluster://h:p,h:p")
        return RedisClusterClient(nodes=nodes, username=user, password=password, **opts)
    if scheme == "memcached":
        servers = [_host_port(h, 11211, url) for h in netloc.split(",") if h.strip()]
        if not servers:
            raise InvalidURL(f"{_mask(url)} names no server; write memcached://host:port")
        return MemcachedClient(servers=servers, **opts)
    if scheme == "memory":
        return MemoryClient(name=netloc or "default", **opts)
    raise InvalidURL(f"unknown scheme {scheme!r} in {_mask(url)}; accepted forms: {ACCEPTED}")
