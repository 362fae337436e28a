"""Prometheus metrics of caches, pipes and nodes (``pip install 'asynccache[metrics]'``).

```python
from prometheus_client import start_http_server
from asynccache.metrics import CacheCollector

CacheCollector(dp)          # registered in prometheus_client's default registry
start_http_server(9100)
```

The collector reads ``stats()`` and ``latency()`` at scrape time: it adds nothing to the
read path. For a pipe or node that is the sum over every process of the job, the
DataLoader workers included (at most about a second old, as ``stats()``). Objects are
held weakly: a collector never keeps a pipe alive, and one that is gone drops out of
the next scrape.

Metrics (``namespace`` and ``store`` labels on all; ``store`` is the URL with any
password masked; objects with the same labels are summed):

* every counter of ``stats()`` as ``asynccache_<name>_total`` and its two sizes as
  gauges: the table of docs/configuration.md ("Counters") gives each one's metric name
  (``bytes_read`` is ``asynccache_read_bytes_total``, ``batch_time_us`` is
  ``asynccache_batch_time_microseconds_total``, ...);
* ``asynccache_errors_total{kind=...}``, ``kind`` one of ``timeouts``, ``unavailable``,
  ``rejected``, ``decode_errors``, ``bad_signatures``, ``other``: they add up to
  ``stats()["errors"]``;
* histogram ``asynccache_request_duration_seconds{kind="read"|"write"}``: one
  observation per store request (a multi-get or a write batch), never per item.

`log_summary()` needs no Prometheus.
"""

from __future__ import annotations

from .observe.prometheus import CacheCollector, SummaryLogger, log_summary, register, summary_line

__all__ = ["CacheCollector", "SummaryLogger", "log_summary", "register", "summary_line"]
