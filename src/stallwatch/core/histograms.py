"""Duration histograms that stallwatch aggregates itself, handed to the readers as the SDK's data.

Values arrive through `faults.Deferred` (an append on the hot path). `collect()` drains them and
returns one `Metric` per histogram, in the SDK's own data types, cumulative, with the contract's
explicit buckets (`telemetry.DURATION_BUCKETS`, on every SDK version). `inject()` appends them to
what a reader collected; stallwatch's metric exporters and its Prometheus reader call it.

Contract: only a pipeline whose readers all take cumulative histograms turns this on (`activate()`);
otherwise, and when the host brings its own MeterProvider, the SDK's histograms are used. Views the
host configures do not apply to these histograms. Exemplars: a rare value recorded inside a sampled
span (`record_exemplar`) is kept as its bucket's exemplar, the last one per bucket and series; OTLP
carries them, and stallwatch's Prometheus reader puts them back on the bucket samples
(`with_exemplars`), which the OpenTelemetry Prometheus exporter would drop.
"""

from __future__ import annotations

import math
import os
import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from .. import telemetry
from .._record import Record
from .._version import __version__

try:
    from opentelemetry.sdk.metrics import Exemplar as _SdkExemplar
except ImportError:  # SDK 1.27: no exemplars in its data points
    _SdkExemplar = None  # type: ignore[misc, assignment]  # the class exists from SDK 1.28 on


class BucketExemplar(Record):
    """The last value recorded inside a sampled span into one bucket of one series."""

    __slots__ = ("span_id", "time_ns", "trace_id", "value")
    value: float
    time_ns: int
    trace_id: int
    span_id: int

    def __init__(self, value: float, time_ns: int, trace_id: int, span_id: int) -> None:
        self._set(value=value, time_ns=time_ns, trace_id=trace_id, span_id=span_id)


class _Series:
    """One attribute set's cumulative state."""

    __slots__ = ("buckets", "count", "high", "low", "start_ns", "total")

    def __init__(self, start_ns: int, buckets: list[int]) -> None:
        self.start_ns = start_ns
        self.buckets = buckets
        self.count = 0
        self.total = 0.0
        self.low = math.inf
        self.high = -math.inf


class OwnHistogram:
    """A cumulative explicit-bucket histogram, aggregated as the SDK's default aggregation does, with
    the metric's buckets (the duration buckets when it names none)."""

    def __init__(self, metric: telemetry.Metric) -> None:
        self.metric = metric
        self.bounds: tuple[float, ...] = metric.buckets or telemetry.DURATION_BUCKETS
        self._series: dict[tuple[tuple[str, Any], ...], _Series] = {}
        self._exemplars: dict[tuple[tuple[str, Any], ...], dict[int, BucketExemplar]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _in_this_process(self) -> None:
        """In a fork child, start empty (the parent's values are the parent's) with a new lock (the
        parent's may have been held by a thread that does not exist here). No fork handler needed."""
        if self._pid != os.getpid():
            self._pid, self._lock, self._series, self._exemplars = os.getpid(), threading.Lock(), {}, {}

    def record(self, value: float, attributes: dict[str, Any]) -> None:
        """Add `value` (negative or non-finite values are ignored, as the SDK ignores them)."""
        self.record_many(((value, attributes),))

    def record_many(self, values: Iterable[tuple[float, dict[str, Any]]]) -> None:
        """Add each `(value, attributes)`, under one lock: a drain hands over thousands at a time,
        most with the very same attributes dict, looked up once per call."""
        self._in_this_process()
        bounds = self.bounds
        by_dict: dict[int, _Series] = {}  # id(attributes) -> series; the dicts live until we return
        with self._lock:
            for value, attributes in values:
                if not 0 <= value < math.inf:
                    continue
                series = by_dict.get(id(attributes))
                if series is None:
                    series = by_dict[id(attributes)] = self._series_of(attributes)
                series.buckets[bisect_left(bounds, value)] += 1  # bucket i: (bounds[i-1], bounds[i]], as the SDK
                series.count += 1
                series.total += value
                if value < series.low:
                    series.low = value
                if value > series.high:
                    series.high = value

    def record_values(self, values: list[float], attributes: dict[str, Any]) -> None:
        """Add every value of `values`, all with `attributes`: what `record_many` does, with the
        per-value work in C: the values sorted once, then one bisect per bucket bound. The executor
        hands over its durations this way."""
        if not values:
            return
        ordered = sorted(values)
        total = sum(ordered)
        if not (ordered[0] >= 0 and ordered[-1] < math.inf and total == total):  # negative, infinite or NaN
            ordered = sorted(value for value in values if 0 <= value < math.inf)  # NaN spoils a sort: again
            if not ordered:
                return
            total = sum(ordered)
        # bucket i holds (bounds[i-1], bounds[i]], as the SDK's bisect_left places a value
        below = [bisect_right(ordered, bound) for bound in self.bounds]
        self._in_this_process()
        with self._lock:
            series = self._series_of(attributes)
            buckets, previous = series.buckets, 0
            for index, count in enumerate(below):
                buckets[index] += count - previous
                previous = count
            buckets[-1] += len(ordered) - previous
            series.count += len(ordered)
            series.total += total
            series.low = min(series.low, ordered[0])
            series.high = max(series.high, ordered[-1])

    def record_exemplar(self, value: float, attributes: dict[str, Any], trace_id: int, span_id: int) -> None:
        """Add `value`, and keep it as its bucket's exemplar, linking to the span `trace_id`/`span_id`."""
        if not 0 <= value < math.inf:
            return
        self.record_values([value], attributes)
        exemplar = BucketExemplar(value, time.time_ns(), trace_id, span_id)
        with self._lock:
            by_bucket = self._exemplars.setdefault(tuple(attributes.items()), {})
            by_bucket[bisect_left(self.bounds, value)] = exemplar

    def bucket_exemplars(self) -> list[tuple[dict[str, Any], float, BucketExemplar]]:
        """(attributes, bucket upper bound, exemplar) of every bucket that has one."""
        self._in_this_process()
        with self._lock:
            return [
                (dict(key), self.bounds[index] if index < len(self.bounds) else math.inf, exemplar)
                for key, by_bucket in self._exemplars.items()
                for index, exemplar in by_bucket.items()
            ]

    def zero(self, attributes: dict[str, Any]) -> None:
        """Make the series of `attributes` exist with no value yet (count 0), so that a backend sees
        its first value as an increase (Prometheus has no `rate()` for a series born with it)."""
        self._in_this_process()
        with self._lock:
            self._series_of(attributes)

    def _series_of(self, attributes: dict[str, Any]) -> _Series:
        """Under the lock: the series of this attribute set, made on first use."""
        key = tuple(attributes.items())
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(time.time_ns(), [0] * (len(self.bounds) + 1))
        return series

    def metric_data(self, now_ns: int) -> Metric | None:
        """The cumulative state as an SDK `Metric`, or None before the first value or `zero()`."""
        self._in_this_process()
        with self._lock:
            points = [
                HistogramDataPoint(
                    attributes=dict(key),
                    start_time_unix_nano=s.start_ns,
                    time_unix_nano=now_ns,
                    count=s.count,
                    sum=s.total,
                    bucket_counts=list(s.buckets),
                    explicit_bounds=list(self.bounds),
                    min=s.low if s.count else None,  # type: ignore[arg-type]  # unset: OTLP's "no value yet"
                    max=s.high if s.count else None,  # type: ignore[arg-type]
                    **_exemplars_of(self._exemplars.get(key)),
                )
                for key, s in self._series.items()
            ]
        if not points:
            return None
        data = Histogram(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE)
        return Metric(name=self.metric.name, description=self.metric.description, unit=self.metric.unit, data=data)


def _exemplars_of(by_bucket: dict[int, BucketExemplar] | None) -> dict[str, Any]:
    """The `exemplars` argument of a data point (none on SDK 1.27, whose points have no such field)."""
    if not by_bucket or _SdkExemplar is None:
        return {}
    return {
        "exemplars": [
            _SdkExemplar(None, e.value, e.time_ns, e.span_id, e.trace_id) for _, e in sorted(by_bucket.items())
        ]
    }


class _Registry:
    """The histograms, the drains that feed them, and the resource their metrics belong to."""

    def __init__(self) -> None:
        self.resource: Resource | None = None  # set by `activate()`: own aggregation is on
        self.histograms: dict[str, OwnHistogram] = {}  # by metric name
        self.drains: dict[str, Callable[[], None]] = {}  # what moves waiting values into each
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @property
    def lock(self) -> threading.Lock:
        """The registry's lock; a new one in a fork child (the parent's may have been held)."""
        if self._pid != os.getpid():
            self._pid, self._lock = os.getpid(), threading.Lock()
        return self._lock


_REGISTRY = _Registry()


def activate(resource: Resource | None) -> None:
    """Aggregate stallwatch's duration histograms here from now on (the pipeline's readers take them),
    or, with None, leave them to the SDK (histograms made from then on)."""
    _REGISTRY.resource = resource


def active() -> bool:
    return _REGISTRY.resource is not None


def register(metric: telemetry.Metric, drain: Callable[[], None]) -> OwnHistogram:
    """The histogram for `metric` (one per name, like the SDK's instruments: an instrumentation
    installed again keeps adding to it); `drain()` is called before each collection to feed it."""
    with _REGISTRY.lock:
        histogram = _REGISTRY.histograms.get(metric.name)
        if histogram is None:
            histogram = _REGISTRY.histograms[metric.name] = OwnHistogram(metric)
        _REGISTRY.drains[metric.name] = drain
    return histogram


def collect() -> list[Metric]:
    """Every histogram that has values, cumulative, as of now."""
    with _REGISTRY.lock:
        drains, histograms = list(_REGISTRY.drains.values()), list(_REGISTRY.histograms.values())
    for drain in drains:
        drain()
    now = time.time_ns()
    return [metric for metric in (h.metric_data(now) for h in histograms) if metric is not None]


def inject(metrics_data: MetricsData | None) -> MetricsData | None:
    """`metrics_data` with stallwatch's histograms added to stallwatch's scope in its first resource
    entry (the provider's resource, refreshed in a fork child), or in a new entry when it has none."""
    if _REGISTRY.resource is None:
        return metrics_data
    metrics = collect()
    if not metrics:
        return metrics_data
    resource_metrics = list(metrics_data.resource_metrics) if metrics_data is not None else []
    if resource_metrics:
        entry = resource_metrics[0]
        resource_metrics[0] = ResourceMetrics(
            resource=entry.resource, scope_metrics=_with(entry.scope_metrics, metrics), schema_url=entry.schema_url
        )
    else:
        resource = _REGISTRY.resource
        resource_metrics.append(
            ResourceMetrics(resource=resource, scope_metrics=_with([], metrics), schema_url=resource.schema_url)
        )
    return MetricsData(resource_metrics=resource_metrics)


def _with(scope_metrics: Iterable[ScopeMetrics], metrics: list[Metric]) -> list[ScopeMetrics]:
    scopes = list(scope_metrics)
    for number, scope in enumerate(scopes):
        if scope.scope.name == telemetry.INSTRUMENTATION_SCOPE:
            scopes[number] = ScopeMetrics(scope=scope.scope, metrics=[*scope.metrics, *metrics],
                                          schema_url=scope.schema_url)  # fmt: skip
            return scopes
    own = InstrumentationScope(telemetry.INSTRUMENTATION_SCOPE, __version__)
    return [*scopes, ScopeMetrics(scope=own, metrics=metrics, schema_url="")]


_PROMETHEUS_NAMES = {metric.name: metric.prometheus_name for metric in telemetry.METRICS}
# The last exemplar collected per (Prometheus histogram name, attributes, bucket bound), from the SDK's
# data, and the process they belong to (a fork child starts without its parent's)
_collected: dict[tuple[str, tuple[tuple[str, Any], ...], float], BucketExemplar] = {}
_collected_pid = [os.getpid()]


def _collected_here() -> dict[tuple[str, tuple[tuple[str, Any], ...], float], BucketExemplar]:
    if _collected_pid[0] != os.getpid():
        _collected_pid[0] = os.getpid()
        _collected.clear()
    return _collected


def note_exemplars(metrics_data: MetricsData | None) -> MetricsData | None:
    """Keep the exemplars of stallwatch's histograms in `metrics_data` (what a Prometheus reader collected,
    SDK 1.28+: its exemplar reservoirs hand each over once), for `with_exemplars`; `metrics_data` as it is."""
    collected = _collected_here()
    for resource_metrics in metrics_data.resource_metrics if metrics_data is not None else ():
        for scope_metrics in resource_metrics.scope_metrics:
            if scope_metrics.scope.name != telemetry.INSTRUMENTATION_SCOPE:
                continue
            for metric in scope_metrics.metrics:
                name = _PROMETHEUS_NAMES.get(metric.name)
                if name is None or not isinstance(metric.data, Histogram):
                    continue
                for point in metric.data.data_points:
                    key = tuple(sorted((point.attributes or {}).items()))
                    bounds = list(point.explicit_bounds)
                    for exemplar in getattr(point, "exemplars", None) or ():
                        if exemplar.trace_id is None or exemplar.span_id is None:
                            continue
                        index = bisect_left(bounds, exemplar.value)
                        bound = bounds[index] if index < len(bounds) else math.inf
                        collected[(name, key, bound)] = BucketExemplar(
                            exemplar.value, exemplar.time_unix_nano, exemplar.trace_id, exemplar.span_id
                        )
    return metrics_data


def with_exemplars(families: Iterable[Any]) -> list[Any]:
    """Prometheus metric families (`prometheus_client`) as the OpenTelemetry exporter made them, with
    each histogram's exemplars (the own histograms', and those collected from the SDK's, `note_exemplars`)
    put on the `_bucket` sample of their series and bucket (matched by name, `le` and the series' labels,
    which the exporter writes with `_` for any other character)."""
    # optional: the prometheus extra
    from prometheus_client.samples import Exemplar

    wanted: dict[tuple[str, float], list[tuple[dict[str, str], BucketExemplar]]] = {}
    with _REGISTRY.lock:
        histograms = list(_REGISTRY.histograms.values())
    for histogram in histograms:
        for attributes, bound, exemplar in histogram.bucket_exemplars():
            labels = {_label(key): str(value) for key, value in attributes.items()}
            wanted.setdefault((f"{histogram.metric.prometheus_name}_bucket", bound), []).append((labels, exemplar))
    for (name, key, bound), exemplar in list(_collected_here().items()):
        labels = {_label(attribute): str(value) for attribute, value in key}
        wanted.setdefault((f"{name}_bucket", bound), []).append((labels, exemplar))
    families = list(families)
    if not wanted:
        return families
    for family in families:
        for index, sample in enumerate(family.samples):
            if not sample.name.endswith("_bucket") or "le" not in sample.labels:
                continue
            for labels, exemplar in wanted.get((sample.name, float(sample.labels["le"])), ()):
                if labels.items() <= sample.labels.items():
                    ids = {"trace_id": f"{exemplar.trace_id:032x}", "span_id": f"{exemplar.span_id:016x}"}
                    family.samples[index] = sample._replace(
                        exemplar=Exemplar(ids, exemplar.value, exemplar.time_ns / 1e9)
                    )
    return families


def _label(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)
