"""Loopback ports and Prometheus scrapes of a host under test (the standard library only: the matrix runs it)."""

from __future__ import annotations

import socket
import urllib.request


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prometheus_env(host_port: int, watchdog_port: int | None = None, **env: str) -> dict[str, str]:
    """Settings for a host that serves its metrics for Prometheus on 127.0.0.1:`host_port` (its freeze watchdog
    on `watchdog_port`, if given), with `env` added; for `clean_env(**...)`."""
    served = {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(host_port),
    }
    if watchdog_port is not None:
        served["STALLWATCH_WATCHDOG_PROMETHEUS_PORT"] = str(watchdog_port)
    return served | env


def scrape(port: int, timeout: float = 5.0) -> str:
    """What 127.0.0.1:`port`/metrics answers, or "no answer: ..." when it refuses, resets or times out."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            return response.read().decode()
    except OSError as exc:  # URLError and socket timeouts
        return f"no answer: {exc}"
