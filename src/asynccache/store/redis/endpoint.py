"""A Redis server's endpoint: where it is, and the ``AUTH`` / ``SELECT`` a connection sends
first (the password is looked up in the process that connects, and kept out of reprs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..protocol.resp import setup_commands
from ..transport.endpoint import Endpoint

__all__ = ["TLS_URL", "RedisEndpoint"]

#: What a plain connection should have used when it hit a TLS port.
TLS_URL = "rediss:// (rediss+cluster:// for a cluster) instead of redis://"


@dataclass(frozen=True, kw_only=True)
class RedisEndpoint(Endpoint):
    kind: str = "redis"
    tls_url: str = TLS_URL
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0

    def setup_requests(self) -> list[bytes]:
        return setup_commands(self.username, self.password, self.db)
