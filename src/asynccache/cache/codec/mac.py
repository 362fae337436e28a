"""Signed values (``Codec(secret=...)``): keyed BLAKE3 MACs from derived keys; the
secrets themselves are never kept (docs/formats.md, docs/security.md)."""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError, MissingDependency
from .format import MAC_SIZE

# The MAC key is derived from each secret with BLAKE3's key-derivation mode, under a
# context naming this format: a secret is never used as a key of another algorithm or
# format, and the fingerprint (derived under another context) reveals nothing of the key.
MAC_CONTEXT = "asynccache format 2 value MAC (keyed BLAKE3, 16-byte tag)"
FINGERPRINT_CONTEXT = "asynccache format 2 secret fingerprint"
KEY_LEN = struct.Struct("<Q")  # length prefix of the store key in the MAC input
MIN_SECRET_BYTES = 16
MAKE_SECRET = 'python -c "import secrets; print(secrets.token_hex(32))"'
ENV_SECRET = "ASYNCCACHE_SECRET"  # Codec.from_env()'s default variable


Secret = bytes | bytearray | str


def secret_list(secret: Secret | Sequence[Secret]) -> list[bytes]:
    """The secrets as bytes, first (signing) one first; ConfigError that never shows them."""
    items = [secret] if isinstance(secret, (bytes, bytearray, str)) else secret
    if not isinstance(items, Sequence) or not items:
        raise ConfigError(
            f"secret must be bytes or str, or a non-empty sequence of them (the first signs, "
            f"all verify); got {type(secret).__name__}. Make one with {MAKE_SECRET}"
        )
    out = []
    for i, item in enumerate(items, 1):
        if isinstance(item, str):
            item = item.encode("utf-8")
        if not isinstance(item, (bytes, bytearray)):
            raise ConfigError(f"secret {i} of {len(items)} is a {type(item).__name__}, not bytes")
        if len(item) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"secret {i} of {len(items)} is {len(item)} bytes; a secret needs at least "
                f"{MIN_SECRET_BYTES} (random ones): make one with {MAKE_SECRET}"
            )
        out.append(bytes(item))
    return out


class Signer:
    """Keyed BLAKE3 hashers derived from a Codec's secrets: the first signs, all verify.

    Only derived keys are kept, inside blake3 hasher objects: there is no Python bytes
    object holding key material to print, compare or pickle (blake3 hashers refuse to be
    pickled or copied with `copy`). Each call starts from a ``copy()`` of the keyed
    hasher, which skips the key setup.
    """

    __slots__ = ("_hashers", "fingerprints")

    def __init__(self, secrets: list[bytes]) -> None:
        try:
            import blake3
        except ImportError as exc:
            raise MissingDependency(
                "Codec(secret=...) needs the blake3 package: pip install blake3"
            ) from exc
        self._hashers = tuple(
            blake3.blake3(key=blake3.blake3(s, derive_key_context=MAC_CONTEXT).digest())
            for s in secrets
        )
        # What __eq__, __hash__, repr and pickles carry instead of the secrets.
        self.fingerprints = tuple(
            blake3.blake3(s, derive_key_context=FINGERPRINT_CONTEXT).hexdigest(8) for s in secrets
        )

    def sign(self, parts: Sequence[Any]) -> bytes:
        """The tag of the concatenated ``parts`` (hashed one by one, never joined)."""
        h = self._hashers[0].copy()
        for part in parts:
            h.update(part)
        return h.digest(MAC_SIZE)

    def verify(self, parts: Sequence[Any], tag: Any) -> bool:
        """True if any secret signed the concatenated ``parts`` with ``tag``.

        Each comparison is constant-time; the number of secrets tried shows in the timing,
        which tells nothing about any key.
        """
        for base in self._hashers:
            h = base.copy()
            for part in parts:
                h.update(part)
            if hmac.compare_digest(h.digest(MAC_SIZE), tag):
                return True
        return False


def mac_prefix(key: bytes, fixed: bytes) -> bytes:
    """What the MAC covers before the payload: the length-prefixed store key (so key and
    payload boundaries are unambiguous) and the 4 fixed header bytes (magic, version,
    flags)."""
    return KEY_LEN.pack(len(key)) + key + fixed
