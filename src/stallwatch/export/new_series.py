"""Every new series of stallwatch's own counters and histograms is exported at zero once first.

The contract: the first collection that carries a label set of one of stallwatch's monotonic sums
(counters, observable counters) or histograms exports it with zero value, count, sum and buckets
and no exemplars; its observations follow in the next collection. Prometheus's `rate()` and
`increase()` need a sample before an event to see it, so a series born with its first value
(a spawn duration by program, loop and method, a child's exit by signal, a Nebius call by method)
would hide exactly that value. A series already exported, or new at zero, is never delayed. Gauges,
up-down counters and the host's own instruments pass unchanged.

One `NewSeries` per reader (each sees its own collections): stallwatch's metric exporters and its
Prometheus reader pass every collection through `delay()`. Cumulative points need no memory beyond
the label sets seen: the next collection carries the whole total. Delta points (a host that prefers
delta) are held and added to the same series' point of the next collection, or exported alone
then, so nothing is counted twice or lost. A push exporter marks its label sets seen (and lets go
of held points) only once the export succeeded (`commit()`), so a zero the backend never took is
sent again; a failed delta export loses what it carried, held values included, as the SDK's own
delta export does. From `finish()` on (the final collection at shutdown) nothing is delayed.
A fork child starts with nothing seen. With two Prometheus servers scraping one endpoint, only the
first scrape of a new series carries its zero.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from .. import telemetry
from ..instrument._common import FAULTS

_Key = tuple[str, frozenset[tuple[str, Any]]]  # metric name, attributes


@dataclass(frozen=True, slots=True)
class _Held:
    """A delta point exported as zero, to be added to its series' next point."""

    resource: Resource
    scope: InstrumentationScope
    metric: Metric
    point: Any
    zeroed_at: int  # the end of the interval its zero covered


class NewSeries:
    """What one reader has exported so far: the label sets seen, and delta points held back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._seen: set[_Key] = set()
        self._held: dict[_Key, _Held] = {}
        self._pending: tuple[set[_Key], dict[_Key, _Held]] | None = None
        self._final = False

    def finish(self) -> None:
        """The final collection(s) are under way: export every value as it is, held ones included."""
        self._final = True

    def delay(self, metrics_data: MetricsData | None, push: bool = False) -> MetricsData | None:
        """`metrics_data` with each new series of stallwatch's counters and histograms at zero.

        `push`: the caller calls `commit(succeeded)` after its export; otherwise the collection
        counts as delivered at once (a scrape)."""
        if metrics_data is None:  # nothing collected (delta, no new value): held points still go out
            if not self._held:
                return None
            metrics_data = MetricsData(resource_metrics=[])
        try:
            return self._delay(metrics_data, push)
        except Exception:  # the collection goes out as it is: nothing lost, a first value unseen by rate()
            FAULTS.record(
                "metrics", "OTEL_METRICS_EXPORTER", "new series could not be exported at zero first", off="none"
            )
            return metrics_data

    def _delay(self, metrics_data: MetricsData, push: bool) -> MetricsData:
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._seen, self._held, self._pending = os.getpid(), set(), {}, None
            seen: set[_Key] = set()
            earlier, made = dict(self._held), dict[_Key, _Held]()
            resource_metrics = [self._resource(entry, seen, earlier, made) for entry in metrics_data.resource_metrics]
            if earlier:  # held delta points whose series have no point in this collection
                now = time.time_ns()
                for held in earlier.values():
                    point = dataclasses.replace(held.point, start_time_unix_nano=held.zeroed_at, time_unix_nano=now)
                    resource_metrics = _add(resource_metrics, held, point)
            if push:
                self._pending = (seen, made)
            else:
                self._seen |= seen
                self._held = made
        return MetricsData(resource_metrics=resource_metrics)

    def commit(self, succeeded: bool) -> None:
        """After a push export: what `delay()` made counts as exported if it `succeeded`."""
        with self._lock:
            if self._pending is None:
                return
            seen, made = self._pending
            self._pending = None
            if succeeded:
                self._seen |= seen
            self._held = made if succeeded else {}

    def _resource(
        self, entry: ResourceMetrics, seen: set[_Key], earlier: dict[_Key, _Held], made: dict[_Key, _Held]
    ) -> ResourceMetrics:
        scopes = [
            ScopeMetrics(
                scope.scope,
                [self._metric(entry.resource, scope.scope, m, seen, earlier, made) for m in scope.metrics],
                scope.schema_url,
            )
            if scope.scope.name == telemetry.INSTRUMENTATION_SCOPE
            else scope
            for scope in entry.scope_metrics
        ]
        return ResourceMetrics(resource=entry.resource, scope_metrics=scopes, schema_url=entry.schema_url)

    def _metric(
        self,
        resource: Resource,
        scope: InstrumentationScope,
        metric: Metric,
        seen: set[_Key],
        earlier: dict[_Key, _Held],
        made: dict[_Key, _Held],
    ) -> Metric:
        """`metric` with its new series at zero; `earlier`: delta points held back last time (each
        taken out as it joins its series' point here); `made`: those held back now."""
        data = metric.data
        if not (isinstance(data, Histogram) or (isinstance(data, Sum) and data.is_monotonic)):
            return metric
        delta = data.aggregation_temporality is AggregationTemporality.DELTA
        points, changed = [], False
        for point in data.data_points:
            key = (metric.name, frozenset((point.attributes or {}).items()))
            seen.add(key)
            held = earlier.pop(key, None) if delta else None
            if held is not None:
                point, changed = _merged(held.point, point), True
            if key in self._seen or self._final or held is not None or _empty(point):
                points.append(point)
                continue
            if delta:
                made[key] = _Held(resource, scope, metric, point, point.time_unix_nano)
            points.append(_zero(point))
            changed = True
        if not changed:
            return metric
        return dataclasses.replace(metric, data=dataclasses.replace(cast(Any, data), data_points=points))


def _empty(point: Any) -> bool:
    return point.count == 0 if isinstance(point, HistogramDataPoint) else point.value == 0


def _zero(point: Any) -> Any:
    """`point` with nothing counted yet."""
    extra: dict[str, Any] = {"exemplars": []} if hasattr(point, "exemplars") else {}  # SDK 1.28+
    if isinstance(point, HistogramDataPoint):
        buckets = [0] * len(point.bucket_counts)
        return dataclasses.replace(point, count=0, sum=0, bucket_counts=buckets, min=None, max=None, **extra)  # type: ignore[arg-type]  # min/max: None for "no value" as the SDK's own empty points
    return dataclasses.replace(point, value=type(point.value)(0), **extra)


def _merged(earlier: Any, point: Any) -> Any:
    """Delta `point` with the values of `earlier` (the same series' point held back) added."""
    extra: dict[str, Any] = {"exemplars": [*earlier.exemplars, *point.exemplars]} if hasattr(point, "exemplars") else {}
    if not isinstance(point, HistogramDataPoint):
        return dataclasses.replace(point, value=earlier.value + point.value, **extra)
    lows = [v for v in (earlier.min, point.min) if v is not None]
    highs = [v for v in (earlier.max, point.max) if v is not None]
    histogram: Any = point
    return dataclasses.replace(
        histogram,
        count=earlier.count + point.count,
        sum=earlier.sum + point.sum,
        bucket_counts=[a + b for a, b in zip(earlier.bucket_counts, point.bucket_counts, strict=True)],
        min=min(lows) if lows else None,
        max=max(highs) if highs else None,
        **extra,
    )


def _add(resource_metrics: list[ResourceMetrics], held: _Held, point: Any) -> list[ResourceMetrics]:
    """`resource_metrics` with `point` added to its metric in its resource and scope (made if absent)."""
    entries = list(resource_metrics)
    at = next((i for i, e in enumerate(entries) if e.resource == held.resource), None)
    if at is None:
        entries.append(ResourceMetrics(resource=held.resource, scope_metrics=[], schema_url=held.resource.schema_url))
        at = len(entries) - 1
    entry = entries[at]
    scopes = list(entry.scope_metrics)
    index = next((i for i, s in enumerate(scopes) if s.scope == held.scope), None)
    if index is None:
        scopes.append(ScopeMetrics(scope=held.scope, metrics=[], schema_url=held.scope.schema_url or ""))
        index = len(scopes) - 1
    metrics = list(scopes[index].metrics)
    found = next((i for i, m in enumerate(metrics) if m.name == held.metric.name), None)
    metric: Any = held.metric if found is None else metrics[found]
    points = [*(metric.data.data_points if found is not None else ()), point]
    metric = dataclasses.replace(metric, data=dataclasses.replace(metric.data, data_points=points))
    if found is None:
        metrics.append(metric)
    else:
        metrics[found] = metric
    scopes[index] = ScopeMetrics(scope=scopes[index].scope, metrics=metrics, schema_url=scopes[index].schema_url)
    entries[at] = ResourceMetrics(resource=entry.resource, scope_metrics=scopes, schema_url=entry.schema_url)
    return entries
