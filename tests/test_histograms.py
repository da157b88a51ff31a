"""stallwatch's own duration histograms aggregate as the SDK does and reach every reader it builds."""

from __future__ import annotations

import gc
import json
import math
import threading

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    InMemoryMetricReader,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from conftest import latest_total, run_python
from stallwatch import telemetry
from stallwatch.core import histograms
from stallwatch.core.faults import Deferred

pytestmark = pytest.mark.matrix  # the SDK's metric data types changed across versions

METRIC = telemetry.EXECUTOR_QUEUE_DURATION
VALUES = [0.0, 0.001, 0.0010001, 0.0025, 0.003, 0.7, 1.0, 59.9, 600.0, 601.0, 1e6, 0.0004]
IGNORED = [-1.0, math.nan, math.inf]  # the SDK refuses these too


def _sdk_point(values: list[float], attributes: dict[str, str]):
    reader = InMemoryMetricReader()
    view = View(instrument_name=METRIC.name, aggregation=ExplicitBucketHistogramAggregation(telemetry.DURATION_BUCKETS))
    provider = MeterProvider(metric_readers=[reader], views=[view])
    histogram = provider.get_meter("reference").create_histogram(METRIC.name, unit=METRIC.unit)
    for value in values:
        if value in IGNORED or math.isnan(value):
            continue  # the SDK logs a warning per refused value; the point is the same
        histogram.record(value, attributes)
    (resource_metrics,) = reader.get_metrics_data().resource_metrics
    (scope_metrics,) = resource_metrics.scope_metrics
    (metric,) = scope_metrics.metrics
    (point,) = metric.data.data_points
    return point


def test_values_land_in_the_same_buckets_with_the_same_count_sum_min_and_max_as_the_sdks():
    attributes = {"stallwatch.executor.name": "pool"}
    own = histograms.OwnHistogram(METRIC)
    for value in VALUES + IGNORED:
        own.record(value, attributes)
    metric = own.metric_data(123)
    assert metric is not None and metric.name == METRIC.name and metric.unit == "s"
    assert metric.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    (point,) = metric.data.data_points
    reference = _sdk_point(VALUES, attributes)
    assert dict(point.attributes) == dict(reference.attributes)
    assert list(point.explicit_bounds) == list(reference.explicit_bounds) == list(telemetry.DURATION_BUCKETS)
    assert list(point.bucket_counts) == list(reference.bucket_counts)
    assert (point.count, point.min, point.max) == (reference.count, reference.min, reference.max) == (12, 0.0, 1e6)
    assert point.sum == pytest.approx(reference.sum)


@pytest.mark.parametrize(
    "batches",
    [
        [VALUES],
        [VALUES + IGNORED],
        [IGNORED, VALUES[:5], [], VALUES[5:]],
        [[-0.0, math.inf, -math.inf, *VALUES]],
        [[0.5, math.nan, 0.001, 2.0, -1.0, 0.0004, *VALUES]],
    ],
    ids=["valid", "with_ignored", "split", "infinities", "nan_inside"],
)
def test_a_batch_of_values_aggregates_as_the_sdk_does_one_by_one(batches):
    """`record_values` (the executor's drain: C-level sum, min, max, bisect) against the SDK's `record`."""
    attributes = {"stallwatch.executor.name": "pool"}
    own = histograms.OwnHistogram(METRIC)
    for batch in batches:
        own.record_values(list(batch), attributes)
    metric = own.metric_data(123)
    assert metric is not None
    (point,) = metric.data.data_points
    reference = _sdk_point([v for batch in batches for v in batch if not math.isinf(v)], attributes)
    assert list(point.bucket_counts) == list(reference.bucket_counts)
    assert (point.count, point.min, point.max) == (reference.count, reference.min, reference.max)
    assert point.sum == pytest.approx(reference.sum)


def test_a_deferred_list_is_drained_once_whatever_is_appended_meanwhile():
    """Values a hot path appends to `Deferred.values_for()` lists reach the histogram exactly once,
    with appends running in another thread during drains."""
    registry = histograms._Registry()
    registry.resource = Resource.create({})
    original = histograms._REGISTRY
    histograms._REGISTRY = registry
    try:
        deferred = Deferred(MeterProvider().get_meter("t"), METRIC, limit=1_000_000)
        values = deferred.values_for({"stallwatch.executor.name": "pool"})
        assert deferred.values_for({"stallwatch.executor.name": "pool"}) is values  # one list per attribute set
        total = 200_000

        def append() -> None:
            for _ in range(total):
                values.append(0.001)

        writer = threading.Thread(target=append)
        writer.start()
        while writer.is_alive():
            deferred.drain()
        writer.join()
        deferred.drain()
        (point,) = registry.histograms[METRIC.name].metric_data(1).data.data_points
        assert point.count == total and not values
    finally:
        histograms._REGISTRY = original


def test_each_attribute_set_is_its_own_series_and_nothing_is_reported_before_a_value():
    own = histograms.OwnHistogram(METRIC)
    assert own.metric_data(1) is None
    own.record(0.5, {"stallwatch.executor.name": "a"})
    own.record(0.5, {"stallwatch.executor.name": "b"})
    own.record(2.0, {"stallwatch.executor.name": "a"})
    metric = own.metric_data(2)
    assert metric is not None
    counts = {point.attributes["stallwatch.executor.name"]: point.count for point in metric.data.data_points}
    assert counts == {"a": 2, "b": 1}


def _other_metric() -> Metric:
    point = NumberDataPoint(attributes={}, start_time_unix_nano=1, time_unix_nano=2, value=3)
    return Metric(name="host.counter", description="", unit="1", data=Sum([point], AggregationTemporality.CUMULATIVE,
                                                                          True))  # fmt: skip


def test_injected_into_stallwatchs_scope_a_new_scope_or_a_new_resource(monkeypatch):
    resource = Resource.create({"service.name": "svc"})
    registry = histograms._Registry()
    monkeypatch.setattr(histograms, "_REGISTRY", registry)
    assert histograms.inject(None) is None  # not active: what the reader collected, untouched
    histograms.activate(resource)
    pending = [0.2, 0.3]
    own = histograms.register(METRIC, lambda: [own.record(pending.pop(), {}) for _ in range(len(pending))])
    assert histograms.register(METRIC, lambda: None) is own  # one histogram per name; the newest drain feeds it

    ours = InstrumentationScope(telemetry.INSTRUMENTATION_SCOPE, "0")
    host = InstrumentationScope("host", "1")
    collected = MetricsData([ResourceMetrics(resource, [ScopeMetrics(host, [_other_metric()], ""),
                                                        ScopeMetrics(ours, [_other_metric()], "")], "")])  # fmt: skip
    own.record(0.1, {})  # the other drain replaced the first one: only this value
    (entry,) = histograms.inject(collected).resource_metrics
    names = [[metric.name for metric in scope.metrics] for scope in entry.scope_metrics]
    assert names == [["host.counter"], ["host.counter", METRIC.name]]
    assert entry.scope_metrics[1].metrics[1].data.data_points[0].count == 1

    (entry,) = histograms.inject(
        MetricsData([ResourceMetrics(resource, [ScopeMetrics(host, [], "")], "")])
    ).resource_metrics
    assert [scope.scope.name for scope in entry.scope_metrics] == ["host", telemetry.INSTRUMENTATION_SCOPE]
    (entry,) = histograms.inject(None).resource_metrics
    assert entry.resource == resource and entry.scope_metrics[0].metrics[0].name == METRIC.name
    refreshed = Resource.create({"service.name": "svc", "process.pid": 2})  # a fork child's, say
    (entry,) = histograms.inject(MetricsData([ResourceMetrics(refreshed, [], "")])).resource_metrics
    assert entry.resource == refreshed and entry.scope_metrics[0].metrics[0].name == METRIC.name


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # our fork, on 3.12+
def test_a_fork_child_starts_its_own_counts():
    import os

    own = histograms.OwnHistogram(METRIC)
    own.record(0.5, {})
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's value is not its own
        own.record(0.7, {})
        metric = own.metric_data(1)
        os.write(write, str(metric.data.data_points[0].count).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"1"
    os.close(read)
    own.record(0.1, {})
    assert own.metric_data(2).data.data_points[0].count == 2


def test_the_file_exporter_gets_the_executor_histograms_once_per_export_with_the_contract_buckets(tmp_path):
    proc = run_python(
        f"""
        import stallwatch
        from concurrent.futures import ThreadPoolExecutor
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False, metric_export_interval_ms=3600000)
        with ThreadPoolExecutor(thread_name_prefix="pool") as pool:
            for _ in range(250):
                pool.submit(pow, 2, 8).result()
        stallwatch.shutdown(10)
        from stallwatch.core import histograms
        print(histograms.active())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "True"  # aggregated by stallwatch, not by the SDK
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    found = []
    for line in lines:
        metrics = [m for r in line.get("resourceMetrics", []) for s in r["scopeMetrics"] for m in s["metrics"]]
        named = [m for m in metrics if m["name"] == METRIC.name]
        assert len(named) <= 1, "one histogram per export"
        found += named
    (point,) = found[-1]["histogram"]["dataPoints"]
    assert int(point["count"]) == 250 and sum(int(c) for c in point["bucketCounts"]) == 250
    assert point["explicitBounds"] == list(telemetry.DURATION_BUCKETS)
    assert {a["key"]: a["value"]["stringValue"] for a in point["attributes"]} == {"stallwatch.executor.name": "pool"}


def test_a_reader_that_wants_delta_histograms_keeps_the_sdks():
    from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    from stallwatch.pipeline import _cumulative_histograms

    def reader(temporality: AggregationTemporality) -> PeriodicExportingMetricReader:
        exporter = ConsoleMetricExporter(preferred_temporality={HistogramInstrument: temporality})
        return PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)

    cumulative, delta = reader(AggregationTemporality.CUMULATIVE), reader(AggregationTemporality.DELTA)
    try:
        assert _cumulative_histograms(cumulative) and not _cumulative_histograms(delta)
    finally:
        cumulative.shutdown()
        delta.shutdown()


def test_values_dropped_past_the_limit_are_reported_as_dropped_metrics(tmp_path):
    """A hot path that keeps recording while no collection drains: what is past `limit` is lost, and
    `stallwatch.telemetry.dropped` {metrics, queue_full} says how much, in the exported metrics."""
    out = tmp_path / "telemetry"
    proc = run_python(
        f"""
        import stallwatch
        from opentelemetry import metrics
        from stallwatch import telemetry
        from stallwatch.core.faults import Deferred
        stallwatch.setup(file_dir={str(out)!r}, watchdog=False, metric_export_interval_ms=3_600_000)
        deferred = Deferred(metrics.get_meter("test"), telemetry.EXECUTOR_QUEUE_DURATION, limit=3)
        for value in range(5):  # `record`: 2 past the limit
            deferred.record(0.001 * value, {{"stallwatch.executor.name": "pool"}})
        values = deferred.values_for({{"stallwatch.executor.name": "pool"}})
        for value in range(4):  # the hot path's own check, as the executor does it: 1 past the limit
            if len(values) < deferred.limit:
                values.append(0.002)
            else:
                deferred.dropped += 1
        stallwatch.shutdown()
        """
    )
    assert proc.returncode == 0, proc.stderr
    metrics_file = out / "metrics.jsonl"
    dropped = latest_total(metrics_file, "stallwatch.telemetry.dropped")
    assert dropped == 3
    assert latest_total(
        metrics_file, "stallwatch.telemetry.dropped",
        **{"stallwatch.telemetry.signal": "metrics", "stallwatch.telemetry.drop_reason": "queue_full"},
    ) == 3  # fmt: skip
    assert latest_total(metrics_file, METRIC.name) == 6  # the 3 + 3 kept values, counted


def test_the_dropped_total_never_goes_down_when_a_deferred_is_collected():
    from stallwatch.core.faults import dropped_values

    before = dropped_values()
    deferred = Deferred(MeterProvider().get_meter("t"), METRIC, limit=1)
    for _ in range(3):
        deferred.record(0.5, {})
    assert dropped_values() == before + 2
    del deferred
    gc.collect()
    assert dropped_values() == before + 2
