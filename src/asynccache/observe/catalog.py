"""Every number ``stats()`` reports, in one table: its name, who reports it, what it is,
and how Prometheus sees it.

The counters a cache keeps (`CACHE_COUNTERS`), those a pipe's prefetchers and a node
add (`PREFETCH_COUNTERS`, `NODE_COUNTERS`), the Prometheus collector's metrics, the
summary line's error kinds and the table in docs/configuration.md are all built from
`CATALOG` (a test holds the docs against `markdown_table()`), so a counter added here is
exported and documented at once, and one that is not exported says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CACHE_COUNTERS", "CATALOG", "ERROR_KINDS", "NODE_COUNTERS", "PREFETCH_COUNTERS",
           "SIZES", "Stat", "exported", "markdown_table"]

#: who reports a number: every cache (and so every pipe and node), a pipe's read-ahead, a
#: node, a ``Tiered`` client (through the cache that reads with it), the pipe and node's
#: miss path
Owner = Literal["cache", "pipe", "node", "tiered", "computing"]
#: ``count``: events or items; ``bytes``/``microseconds``: sums of those; ``size``: a
#: level now (a gauge), not a count; ``error``: a kind of store failure, part of ``errors``
Kind = Literal["count", "bytes", "microseconds", "size", "error"]


@dataclass(frozen=True)
class Stat:
    """One number of ``stats()``."""

    name: str
    owners: tuple[Owner, ...]
    kind: Kind
    help: str
    #: the Prometheus name without ``asynccache_`` (and ``_total`` for counters); None:
    #: not a metric of its own, and ``why_not`` says why
    metric: str | None
    why_not: str = ""


_C: tuple[Owner, ...] = ("cache",)
_READERS: tuple[Owner, ...] = ("cache", "pipe", "node")
_AHEAD: tuple[Owner, ...] = ("pipe", "node")
_BY_KIND = "a `kind` of `asynccache_errors_total`"

CATALOG: tuple[Stat, ...] = (
    Stat("hits", _READERS, "count",
         "Reads answered from the cache (store or in-process L1).", "hits"),
    Stat("misses", _READERS, "count",
         "Reads the cache could not answer (computed, or waited for under a lease).",
         "misses"),
    Stat("recalled", _C, "count",
         "Reads answered from this process's record of its own writes (not a hit, not a "
         "miss).", "recalled"),
    Stat("errors", _C, "count",
         "Store failures: timeouts + unavailable + rejected + decode_errors + "
         "bad_signatures + other.", None,
         "`asynccache_errors_total{kind=...}`: by kind (they sum to it)"),
    Stat("timeouts", _C, "error", "Store requests that timed out.", None, _BY_KIND),
    Stat("unavailable", _C, "error", "Store requests that could not connect.", None,
         _BY_KIND),
    Stat("rejected", _C, "error", "Values the store refused (too large, out of memory).",
         None, _BY_KIND),
    Stat("decode_errors", _C, "error", "Values read that could not be decoded.", None,
         _BY_KIND),
    Stat("bad_signatures", _C, "error", "Signed values whose signature did not verify.",
         None, _BY_KIND),
    Stat("outdated", _C, "count",
         "Values of another format version: misses, not errors.", "outdated"),
    Stat("skipped", _C, "count", "Keys not asked for because their node was backing off.",
         "skipped"),
    Stat("batches", _C, "count", "Multi-get requests sent.", "batches"),
    Stat("keys_requested", _C, "count", "Keys asked for in multi-gets.", "keys_requested"),
    Stat("coalesced", _C, "count",
         "get() calls that joined another call for the same key in one loop tick.",
         "coalesced"),
    Stat("bytes_read", _C, "bytes", "Bytes of values read from the store.", "read_bytes"),
    Stat("sets", _C, "count", "Values written to the store.", "sets"),
    Stat("set_batches", _C, "count", "Write requests sent.", "set_batches"),
    Stat("bytes_written", _C, "bytes", "Bytes of values written to the store.",
         "written_bytes"),
    Stat("writes_dropped", _C, "count", "Values that could not be written.",
         "writes_dropped"),
    Stat("writes_forgotten", _C, "count",
         "Values not written whose copy kept for read-your-writes was dropped past its "
         "budget (64 MiB).", "writes_forgotten"),
    Stat("rewritten", _C, "count",
         "Kept values written again once the store answered after failing (or lost them).",
         "rewritten"),
    Stat("chunked_values", _C, "count",
         "Values over the store's item size, written as chunks.", "chunked_values"),
    Stat("batch_time_us", _C, "microseconds",
         "Time multi-gets took, a slot in flight waited for included.",
         "batch_time_microseconds"),
    Stat("leases", _C, "count", "Keys whose lease this process took, to compute them.",
         "leases"),
    Stat("lease_waits", _C, "count", "Keys waited for while another process held the lease.",
         "lease_waits"),
    Stat("lease_hits", _C, "count", "Values another process computed under its lease.",
         "lease_hits"),
    Stat("lease_timeouts", _C, "count",
         "Keys waited for the whole lease, then computed here.", "lease_timeouts"),
    Stat("l1_hits", _C, "count", "Hits served by the in-process L1 tier.", "l1_hits"),
    Stat("unstored_values", _C, "size",
         "Values kept here because the store lacks them (their write failed or was "
         "dropped).", "unstored_values"),
    Stat("kept_bytes", _C, "size", "Memory of the read-your-writes record, in bytes.",
         "kept_bytes"),
    Stat("computed", ("computing",), "count",
         "Values computed from the source on a miss.", "computed"),
    Stat("prefetch_hits", _AHEAD, "count",
         "Hits that read-ahead had brought before they were asked for.", "prefetch_hits"),
    Stat("stalls", _AHEAD, "count", "Reads that waited for read-ahead in flight.", "stalls"),
    Stat("stall_us", _AHEAD, "microseconds", "Time reads waited for read-ahead in flight.",
         "stall_microseconds"),
    Stat("stall_timeouts", _AHEAD, "count",
         "Read-ahead requests abandoned at their deadline (their keys read again).",
         "stall_timeouts"),
    Stat("interrupted_reads", _AHEAD, "count",
         "Reads stopped by an exception (an interrupt) and repaired at the next read.",
         "interrupted_reads"),
    Stat("direct_reads", ("pipe",), "count",
         "Reads not read ahead: asked for in a request of their own.", "direct_reads"),
    Stat("prefetch_wasted", ("pipe",), "count",
         "Values read ahead and never asked for.", "prefetch_wasted"),
    Stat("readahead_stopped", ("pipe",), "count",
         "Times read-ahead stopped guessing an order the reads did not follow.",
         "readahead_stopped"),
    Stat("computed_ahead", ("node",), "count",
         "Of the computed values, those the node's workers computed ahead of the read.",
         "computed_ahead"),
    Stat("tier_near_hits", ("tiered",), "count", "Keys a tiered client's near store answered.",
         "tier_near_hits"),
    Stat("tier_far_hits", ("tiered",), "count",
         "Keys read from far after near did not have them.", "tier_far_hits"),
    Stat("tier_copies", ("tiered",), "count", "Far hits copied into near.", "tier_copies"),
    Stat("tier_near_refused", ("tiered",), "count", "Values near refused (full).",
         "tier_near_refused"),
    Stat("tier_near_dropped", ("tiered",), "count",
         "Values not written to near (copy budget spent, or near refusing or failing "
         "lately).", "tier_near_dropped"),
    Stat("tier_copy_failed", ("tiered",), "count", "Copies into near that failed.",
         "tier_copy_failed"),
    Stat("tier_copies_undone", ("tiered",), "count",
         "Copies into near deleted again: far held a newer value (another process wrote "
         "it).", "tier_copies_undone"),
)

#: Counters every cache keeps, even at zero (its sizes are read, not counted).
CACHE_COUNTERS = tuple(s.name for s in CATALOG if "cache" in s.owners and s.kind != "size")
#: The sizes a cache reports next to its counters (levels now, gauges in Prometheus).
SIZES = tuple(s.name for s in CATALOG if s.kind == "size")
#: Counters a pipe's prefetcher keeps.
PREFETCH_COUNTERS = tuple(s.name for s in CATALOG if "pipe" in s.owners)
#: Counters a node keeps of its own.
NODE_COUNTERS = tuple(s.name for s in CATALOG if "node" in s.owners)
#: The kinds ``errors`` is made of; what is left of it is "other".
ERROR_KINDS = tuple(s.name for s in CATALOG if s.kind == "error")


def exported() -> tuple[Stat, ...]:
    """The numbers that are Prometheus metrics of their own."""
    return tuple(s for s in CATALOG if s.metric is not None)


_OWNER_WORDS = {"cache": "cache", "pipe": "pipe", "node": "node", "tiered": "tiered client",
                "computing": "pipe, node"}


def _metric_text(stat: Stat) -> str:
    if stat.metric is None:
        return stat.why_not
    if stat.kind == "size":
        return f"`asynccache_{stat.metric}` (gauge)"
    return f"`asynccache_{stat.metric}_total`"


def markdown_table() -> str:
    """The table of docs/configuration.md, made from `CATALOG`."""
    rows = ["| `stats()` name | reported by | Prometheus | what it counts |",
            "|---|---|---|---|"]
    for stat in CATALOG:
        owners = ", ".join(dict.fromkeys(_OWNER_WORDS[o] for o in stat.owners))
        rows.append(f"| `{stat.name}` | {owners} | {_metric_text(stat)} | {stat.help} |")
    return "\n".join(rows) + "\n"
