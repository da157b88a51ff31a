"""A host's and its watchdog's Prometheus series carry the host's service.name and service.instance.id,
on every exporter-prometheus version the matrix runs (0.48b0 has no resource_attribute_filter)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import clean_env, run_python
from support.loopback import free_port, prometheus_env

pytestmark = pytest.mark.matrix  # how the labels get there depends on the exporter's version

SCRAPING_HOST = """
import json, subprocess, sys, urllib.request
import stallwatch

session = stallwatch.setup(freeze_threshold=1.0)
assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"
subprocess.run([sys.executable, "-c", "pass"], check=True)  # a spawn: histograms and counters with labels
scrapes = {}
for name, port in (("host", sys.argv[1]), ("watchdog", sys.argv[2])):
    for attempt in range(2):  # twice: the second scrape labels what the first one cached (target_info)
        scrapes[name] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
print(json.dumps(scrapes))
stallwatch.shutdown()
"""


def _opentelemetry_samples(scrape: str) -> list[str]:
    """The sample lines the OpenTelemetry reader serves (prometheus_client's own python_/process_ aside)."""
    return [line for line in scrape.splitlines() if line and not line.startswith(("#", "python_", "process_"))]


def test_every_series_of_a_host_and_its_watchdog_carries_the_hosts_service_name_and_instance_id():
    host_port, watchdog_port = free_port(), free_port()
    env = clean_env(
        **prometheus_env(
            host_port,
            watchdog_port,
            OTEL_SERVICE_NAME="checkout",
            OTEL_RESOURCE_ATTRIBUTES="service.instance.id=checkout-7",
            OTEL_TRACES_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none",
        )
    )
    result = run_python(f"import sys; sys.argv[1:] = ['{host_port}', '{watchdog_port}']\n{SCRAPING_HOST}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""  # the host's output is its own: no SDK warning about an early collect
    scrapes = json.loads(result.stdout)

    for process, scrape in scrapes.items():
        samples = _opentelemetry_samples(scrape)
        names = {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0) for line in samples}  # type: ignore[union-attr]
        assert "target_info" in names and any(name.startswith("stallwatch_") for name in names), (process, names)
        for line in samples:
            labels = line[: line.rindex("}") + 1] if "{" in line else ""
            assert 'service_name="checkout"' in labels, (process, line)
            assert 'service_instance_id="checkout-7"' in labels, (process, line)
            assert labels.count("service_instance_id=") == 1, (process, line)
    host_names = {line.split("{")[0] for line in _opentelemetry_samples(scrapes["host"])}
    assert "stallwatch_subprocess_spawn_duration_seconds_bucket" in host_names, host_names
