"""The Prometheus collector and the summary line's public entry points; the metric names
are listed in `asynccache.metrics` (the public path)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError, MissingDependency
from .catalog import ERROR_KINDS, exported
from .histogram import KINDS, Latency, merge
from .stats import HIT_RATE
from .summary import SummaryLogger, log_summary, summary_line

__all__ = ["CacheCollector", "SummaryLogger", "log_summary", "register", "summary_line"]

#: "prometheus_client's default registry" (None means: do not register)
_DEFAULT_REGISTRY: Any = object()


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.utils
    except ImportError as exc:
        raise MissingDependency(
            "asynccache.metrics.CacheCollector needs prometheus_client: "
            "pip install 'asynccache[metrics]'"
        ) from exc
    return prometheus_client


def _labels(obj: Any) -> tuple[str, str]:
    client = getattr(obj, "client", None)
    store = getattr(client, "safe_url", None)
    if not (callable(getattr(obj, "stats", None)) and callable(getattr(obj, "latency", None))
            and isinstance(getattr(obj, "namespace", None), str) and isinstance(store, str)):
        raise ConfigError(f"CacheCollector takes AsyncKVCache, AsyncKVCacheMapDataPipe or "
                          f"CachedMapper objects, got {type(obj).__name__}")
    return obj.namespace, store


class CacheCollector:
    """A ``prometheus_client`` collector for caches, pipes and nodes (held weakly).

    A registry takes one collector of these names: add objects to it with `add()`, or
    use `register()`.

    Args:
        *objects: `AsyncKVCache`, `AsyncKVCacheMapDataPipe` or `CachedMapper` objects.
        registry: where to register (default: prometheus_client's ``REGISTRY``; None:
            not registered, for a registry of your own later).
    """

    def __init__(self, *objects: Any, registry: Any = _DEFAULT_REGISTRY) -> None:
        self._prom = _prometheus()
        self._targets: list[tuple[weakref.ref[Any], tuple[str, str]]] = []
        for obj in objects:
            self.add(obj)
        if registry is _DEFAULT_REGISTRY:
            registry = self._prom.REGISTRY
        if registry is not None:
            registry.register(self)

    def add(self, obj: Any) -> None:
        """Report ``obj`` too (validated now, held weakly)."""
        labels = _labels(obj)
        self._targets.append((weakref.ref(obj), labels))

    def _readings(self) -> dict[tuple[str, str], tuple[dict[str, int], dict[str, Latency]]]:
        """``{(namespace, store): (stats, latency)}``, summed over objects sharing labels."""
        out: dict[tuple[str, str], tuple[dict[str, int], dict[str, Latency]]] = {}
        live = []
        for ref, labels in self._targets:
            obj = ref()
            if obj is None:
                continue
            live.append((ref, labels))
            stats = {k: v for k, v in obj.stats().items() if k != HIT_RATE}  # counters
            latency = obj.latency()
            if labels in out:
                total, lat = out[labels]
                stats = {k: total.get(k, 0) + stats.get(k, 0) for k in {*total, *stats}}
                latency = merge([lat, latency])
            out[labels] = (stats, latency)
        self._targets = live
        return out

    def describe(self) -> list[Any]:
        """The metric names, without reading any stats (registration stays cheap)."""
        return list(self._families({}))

    def collect(self) -> Iterator[Any]:
        yield from self._families(self._readings())

    def _families(self, readings: dict[tuple[str, str], tuple[dict[str, int],
                                                               dict[str, Latency]]]
                  ) -> Iterator[Any]:
        core = self._prom.core
        go_float = self._prom.utils.floatToGoString

        labels = ["namespace", "store"]
        for stat in exported():  # every number of the catalog that is a metric of its own
            family = (core.GaugeMetricFamily if stat.kind == "size"
                      else core.CounterMetricFamily)(
                f"asynccache_{stat.metric}", stat.help, labels=labels)
            for key, (stats, _latency) in readings.items():
                family.add_metric(list(key), stats.get(stat.name, 0))
            yield family
        errors = core.CounterMetricFamily(
            "asynccache_errors", "Store failures, by kind (they sum to stats()['errors']).",
            labels=[*labels, "kind"])
        for key, (stats, _latency) in readings.items():
            for kind in ERROR_KINDS:
                errors.add_metric([*key, kind], stats.get(kind, 0))
            other = stats.get("errors", 0) - sum(stats.get(kind, 0) for kind in ERROR_KINDS)
            errors.add_metric([*key, "other"], max(other, 0))
        yield errors
        histogram = core.HistogramMetricFamily(
            "asynccache_request_duration_seconds",
            "Duration of store requests (one per multi-get or write batch, not per item).",
            labels=[*labels, "kind"])
        for key, (_stats, latency) in readings.items():
            for kind in KINDS:
                lat = latency.get(kind, Latency())
                buckets = [(go_float(bound), n) for bound, n in lat.cumulative()]
                histogram.add_metric([*key, kind], buckets, lat.sum)
        yield histogram


_per_registry: weakref.WeakKeyDictionary[Any, CacheCollector] = weakref.WeakKeyDictionary()
_per_registry_lock = threading.Lock()


def register(*objects: Any, registry: Any = _DEFAULT_REGISTRY) -> CacheCollector:
    """Report ``objects`` in ``registry``.

    One collector per registry, made on the first call and reused after (a registry
    refuses two collectors with the same metric names): call it for each new pipe,
    node or cache, e.g. every epoch, as often as you like.

    Args:
        *objects: caches, pipes or nodes, as for `CacheCollector`.
        registry: default: prometheus_client's ``REGISTRY``.

    Returns:
        The registry's one `CacheCollector`.
    """
    if registry is _DEFAULT_REGISTRY:
        registry = _prometheus().REGISTRY
    with _per_registry_lock:
        collector = _per_registry.get(registry)
        if collector is None:
            collector = _per_registry[registry] = CacheCollector(*objects, registry=registry)
            return collector
    for obj in objects:
        collector.add(obj)
    return collector
