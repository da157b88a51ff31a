"""A host's Views apply to stallwatch's instruments: with STALLWATCH_PROVIDERS=host, stallwatch records
through the host's MeterProvider, whose Views rename, drop and re-bucket its duration histograms, with
the fast paths on or off (the environment's mode, set per matrix environment by tests/run.sh).

With STALLWATCH_PROVIDERS=stallwatch, setup() builds the MeterProvider and takes no Views: a host that
needs them brings its own provider (this mode)."""

from __future__ import annotations

import json

import pytest

from conftest import clean_env, run_python

pytestmark = pytest.mark.matrix  # the SDK's Views and histogram data across its versions

HOST = """
import json
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import DropAggregation, ExplicitBucketHistogramAggregation, View

reader = InMemoryMetricReader()
views = [
    View(instrument_name="stallwatch.executor.queue.duration", name="host.queue.wait"),
    View(
        instrument_name="stallwatch.executor.run.duration",
        aggregation=ExplicitBucketHistogramAggregation((0.5, 60.0)),
    ),
    View(instrument_name="stallwatch.executor.pending", aggregation=DropAggregation()),
]
metrics.set_meter_provider(MeterProvider(metric_readers=[reader], views=views))

import stallwatch

stallwatch.setup(providers="host", watchdog=False)
with ThreadPoolExecutor(thread_name_prefix="views") as pool:
    for _ in range(3):
        pool.submit(sum, (1, 2)).result()
seen = {}
for resource_metrics in reader.get_metrics_data().resource_metrics:
    for scope_metrics in resource_metrics.scope_metrics:
        for metric in scope_metrics.metrics:
            points = list(metric.data.data_points)
            seen[metric.name] = {
                "count": sum(getattr(p, "count", 0) for p in points),
                "bounds": [list(p.explicit_bounds) for p in points if hasattr(p, "explicit_bounds")],
            }
print(json.dumps(seen))
"""


def test_the_hosts_views_rename_drop_and_rebucket_stallwatchs_instruments():
    proc = run_python(HOST, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "stallwatch.executor.queue.duration" not in seen
    assert seen["host.queue.wait"]["count"] == 3
    assert seen["stallwatch.executor.run.duration"]["count"] == 3
    assert seen["stallwatch.executor.run.duration"]["bounds"] == [[0.5, 60.0]]
    assert "stallwatch.executor.pending" not in seen
    assert "stallwatch.executor.workers" in seen  # an instrument no View names is as stallwatch made it
