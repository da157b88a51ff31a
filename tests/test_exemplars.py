"""From a freeze to its trace through Prometheus: the watchdog's freeze-duration histogram carries
an exemplar with the trace id of the host's span that froze, stored by a real Prometheus 2.42+
(exemplar storage on) scraping the watchdog's OpenMetrics endpoint, and in OTLP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import SCENARIOS, clean_env, metric_points
from support.loopback import free_port, prometheus_env
from support.prometheus import HAVE_PROMETHEUS, Prometheus

pytestmark = [
    pytest.mark.skipif(not HAVE_PROMETHEUS, reason="needs prometheus: apt-get install prometheus"),
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watchdog needs pidfd_open (Linux 5.3+)"),
]


def test_prometheus_stores_the_freeze_duration_exemplar_with_the_frozen_spans_trace_id(telemetry_dir, tmp_path):
    pytest.importorskip("prometheus_client", reason="needs the prometheus extra")
    host_port, watchdog_port = free_port(), free_port()
    jobs = {"stallwatch": [f"127.0.0.1:{host_port}"], "stallwatch-watchdog": [f"127.0.0.1:{watchdog_port}"]}
    prometheus = Prometheus.scraping(tmp_path, jobs, interval="1s", features=("exemplar-storage",))
    try:
        started = time.time()
        env = clean_env(**prometheus_env(host_port, watchdog_port))
        probe = [sys.executable, str(SCENARIOS / "freeze_probe.py"), str(telemetry_dir), "2", "--block-loop",
                 "--linger=5"]  # fmt: skip
        proc = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.splitlines()[-1])

        deadline, stored = time.monotonic() + 30, []
        while not stored:
            assert time.monotonic() < deadline, prometheus.log_path.read_text()[-2000:]
            found = prometheus.api(
                "query_exemplars", query="stallwatch_freeze_duration_seconds_bucket", start=started, end=time.time()
            )["data"]
            stored = [e for series in found for e in series["exemplars"]]
            time.sleep(0.2)
    finally:
        prometheus.stop()

    (exemplar,) = stored  # one freeze, one exemplar: in the bucket of its duration
    assert exemplar["labels"] == {"trace_id": result["trace_id"], "span_id": result["span_id"]}
    assert 1.9 <= float(exemplar["value"]) < 10


def test_the_freeze_duration_in_otlp_carries_an_exemplar_with_the_frozen_spans_trace_id(telemetry_dir):
    from opentelemetry.sdk import metrics as sdk_metrics

    if not hasattr(sdk_metrics, "Exemplar"):
        pytest.skip("opentelemetry-sdk before 1.28 has no exemplars")
    proc = subprocess.run(
        [sys.executable, str(SCENARIOS / "freeze_probe.py"), str(telemetry_dir), "2", "--block-loop"],
        env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])

    points = metric_points(telemetry_dir / "metrics.jsonl", "stallwatch.freeze.duration")
    exemplars = {(e["traceId"], e["spanId"]) for point in points for e in point.get("exemplars", [])}
    assert exemplars == {(result["trace_id"], result["span_id"])}
