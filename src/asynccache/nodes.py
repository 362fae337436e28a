"""``CachedMapper``: the cache as a ``torchdata.nodes`` node (public path; the code is in
`asynccache.readahead.nodes`). Importing it imports torch and torchdata."""

from .readahead.nodes import CachedMapper, NodeIterable

__all__ = ["CachedMapper", "NodeIterable"]
