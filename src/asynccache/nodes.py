"""``CachedMapper``: the cache as a ``torchdata.nodes`` node (public path; the code is in
`asynccache.readahead.mapper`). Importing it imports torch and torchdata."""

from .readahead.mapper import CachedMapper, NodeIterable

__all__ = ["CachedMapper", "NodeIterable"]
