"""Series whose labels are known in advance exist at zero before their first event, so Prometheus's
`increase()` and `rate()` see that event (a series born with it has nothing to compare with).
A real host's own Prometheus endpoint, scraped before anything went wrong."""

from __future__ import annotations

import json
import re
import socket

from conftest import clean_env, run_python
from stallwatch import telemetry


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _series(scrape: str, name: str, **labels: str) -> dict[str, float]:
    """`{labels text: value}` of every sample of `name` whose labels include `labels`."""
    found = {}
    for line in scrape.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            found[match.group(1)] = float(match.group(2))
    return found


def test_a_new_pool_and_a_new_execution_timeout_have_their_event_series_at_zero_before_any_event():
    port = _free_port()
    env = clean_env(
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
    )
    proc = run_python(
        f"""
        import asyncio, json, urllib.request
        import stallwatch
        stallwatch.setup(watchdog=False)
        from concurrent.futures import ThreadPoolExecutor

        async def guarded():
            async with stallwatch.execution_timeout(30, name="checkout"):
                await asyncio.sleep(0)

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool")
        pool.submit(lambda: None).result()
        asyncio.run(guarded())
        scrape = urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        stallwatch.shutdown(5)
        print(json.dumps(scrape))
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    scrape = json.loads(proc.stdout.splitlines()[-1])
    pool = {"stallwatch_executor_name": "pool"}

    wedges = _series(scrape, telemetry.WEDGE_DETECTED.prometheus_name, **pool)
    assert sorted(re.search(r'stallwatch_wedge_kind="(\w+)"', key)[1] for key in wedges) == sorted(
        telemetry.WEDGE_KIND.values
    )
    assert set(wedges.values()) == {0.0}
    for metric in (
        telemetry.EXECUTOR_ORPHANED,
        telemetry.EXECUTOR_HEALED,
        telemetry.EXECUTOR_ORPHANED_OUTSTANDING,
        telemetry.ASYNC_EXC_INJECTED,
        telemetry.ASYNC_EXC_DELIVERED,
        telemetry.ASYNC_EXC_REVOKED,
        telemetry.ASYNC_EXC_REFUSED,
    ):
        assert list(_series(scrape, metric.prometheus_name, **pool).values()) == [0.0], metric.name
    checkout = {"stallwatch_execution_name": "checkout"}
    assert list(_series(scrape, telemetry.EXECUTION_TIMEOUTS.prometheus_name, **checkout).values()) == [0.0]
    overrun = telemetry.EXECUTION_OVERRUN_DURATION.prometheus_name
    assert list(_series(scrape, f"{overrun}_count", **checkout).values()) == [0.0]
    assert list(_series(scrape, telemetry.EXECUTION_OVERDUE.prometheus_name, **checkout).values()) == [0.0]
    dropped = _series(scrape, telemetry.TELEMETRY_DROPPED.prometheus_name)
    assert len(dropped) == len(telemetry.TELEMETRY_SIGNAL.values) * len(telemetry.DROP_REASON.values)
    forks = _series(scrape, telemetry.FORK_COUNT.prometheus_name)
    assert len(forks) == len(telemetry.FORK_KIND.values) * 2 * len(telemetry.SPAWN_LOOP.values)


def _export_values(line: str, name: str, attribute: str, value: str) -> list[float]:
    """The values (count for a histogram) of `name`'s points whose `attribute` is `value` in one OTLP/JSON export."""
    found = []
    for resource in json.loads(line).get("resourceMetrics", []):
        for scope in resource.get("scopeMetrics", []):
            for metric in scope.get("metrics", []):
                if metric["name"] != name:
                    continue
                data = metric.get("sum") or metric.get("histogram") or {}
                for point in data.get("dataPoints", []):
                    if {"key": attribute, "value": {"stringValue": value}} in point.get("attributes", []):
                        found.append(float(point.get("asInt", point.get("asDouble", point.get("count", 0)))))
    return found


def test_a_series_born_with_its_first_value_is_exported_at_zero_first_and_with_the_value_next(tmp_path):
    port = _free_port()
    env = clean_env(
        OTEL_METRICS_EXPORTER="prometheus,file",
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
        OTEL_METRIC_EXPORT_INTERVAL="3600000",  # exports only when the script flushes
        STALLWATCH_FILE_DIR=str(tmp_path),
    )
    proc = run_python(
        f"""
        import json, subprocess, urllib.request
        import stallwatch
        from opentelemetry import metrics
        stallwatch.setup(watchdog=False)

        def scrape():
            return urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

        scrapes = [scrape()]  # before the child: its series do not exist yet
        subprocess.run(["true"], check=True)  # a new program: new spawn-duration and exit series
        scrapes += [scrape(), scrape()]
        metrics.get_meter_provider().force_flush()
        metrics.get_meter_provider().force_flush()
        subprocess.run(["true"], check=True)  # the series exist now: counted in the very next collection
        scrapes.append(scrape())
        metrics.get_meter_provider().force_flush()
        stallwatch.shutdown(5)
        print(json.dumps(scrapes))
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    scrapes = json.loads(proc.stdout.splitlines()[-1])
    program = {"process_executable_name": "true"}
    spawns = f"{telemetry.SUBPROCESS_SPAWN_DURATION.prometheus_name}_count"
    exits = telemetry.SUBPROCESS_EXITS.prometheus_name
    assert [list(_series(scrape, spawns, **program).values()) for scrape in scrapes] == [[], [0.0], [1.0], [2.0]]
    assert [sum(_series(scrape, exits, **program).values()) for scrape in scrapes] == [0.0, 0.0, 1.0, 2.0]

    exports = (tmp_path / "metrics.jsonl").read_text().splitlines()
    name, key = telemetry.PROCESS_EXECUTABLE_NAME.name, "true"
    spawned = [_export_values(line, telemetry.SUBPROCESS_SPAWN_DURATION.name, name, key) for line in exports]
    exited = [_export_values(line, telemetry.SUBPROCESS_EXITS.name, name, key) for line in exports]
    assert spawned[:3] == [[0.0], [1.0], [2.0]], spawned
    assert exited[:3] == [[0.0], [1.0], [2.0]], exited


def test_with_delta_temporality_a_new_series_value_held_back_once_is_counted_exactly_once():
    # The SDK's own in-memory reader preferring delta, as a host with
    # OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE=delta gets; no OTLP backend needed to read deltas.
    from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

    from stallwatch.export.new_series import NewSeries

    delta = {Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA}
    reader = InMemoryMetricReader(preferred_temporality=delta)
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter(telemetry.INSTRUMENTATION_SCOPE)
    counter = meter.create_counter("stallwatch.test.events")
    histogram = meter.create_histogram("stallwatch.test.duration")
    new_series = NewSeries()

    def collect() -> dict[str, float]:
        data = new_series.delay(reader.get_metrics_data())
        values = {}
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        values[metric.name] = getattr(point, "value", getattr(point, "count", None))
        return values

    counter.add(3, {"kind": "a"})
    histogram.record(30.0, {"kind": "a"})
    first = collect()
    second = collect()  # nothing new meanwhile: the held values go out alone
    counter.add(2, {"kind": "a"})
    histogram.record(1.0, {"kind": "a"})
    third = collect()
    provider.shutdown()

    assert first == {"stallwatch.test.events": 0, "stallwatch.test.duration": 0}
    assert second == {"stallwatch.test.events": 3, "stallwatch.test.duration": 1}
    assert third == {"stallwatch.test.events": 2, "stallwatch.test.duration": 1}


def test_with_delta_temporality_a_held_back_value_joins_its_series_next_point():
    from opentelemetry.sdk.metrics import Counter, MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

    from stallwatch.export.new_series import NewSeries

    reader = InMemoryMetricReader(preferred_temporality={Counter: AggregationTemporality.DELTA})
    provider = MeterProvider(metric_readers=[reader])
    counter = provider.get_meter(telemetry.INSTRUMENTATION_SCOPE).create_counter("stallwatch.test.events")
    new_series = NewSeries()

    def collect() -> list[float]:
        data = new_series.delay(reader.get_metrics_data())
        return [
            point.value
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            for point in metric.data.data_points
        ]

    counter.add(3, {"kind": "a"})
    first = collect()
    counter.add(2, {"kind": "a"})
    second = collect()
    counter.add(1, {"kind": "a"})
    third = collect()
    provider.shutdown()
    assert (first, second, third) == ([0], [5], [1])
