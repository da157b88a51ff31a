"""Loopback ports and Prometheus scrapes of a host under test (the standard library only: the matrix runs it)."""

from __future__ import annotations

import socket
import subprocess
import sys
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


_HOLDER = """
import socket, sys
held = socket.create_server(("127.0.0.1", 0))
print(held.getsockname()[1], flush=True)
sys.stdin.read()
"""


class HeldPort:
    """A loopback port another program listens on: a process in a session (and process group) of its own,
    not of the server under test, as a port taken by a misconfiguration is. `free()` (or leaving) ends it."""

    def __init__(self) -> None:
        self._holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        assert self._holder.stdout is not None
        self.port = int(self._holder.stdout.readline())

    def free(self) -> None:
        self._holder.kill()
        self._holder.wait(30)

    def __enter__(self) -> int:
        return self.port

    def __exit__(self, *exc: object) -> None:
        self.free()
