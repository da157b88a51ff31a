"""Shared protocol of the dash_*.py scenarios that tests/test_dashboards.py runs under a real Prometheus.

A scenario sets stallwatch up (OTEL_METRICS_EXPORTER=prometheus and the ports come from the
environment), prints a JSON line with "ready", waits for a line on stdin (Prometheus scrapes it by
then), does its work, prints a JSON line with "done" and keeps serving its metrics until stdin closes.
A state that a 15 s scrape must see is held with `hold(name)` until the test releases it.
"""

import json
import os
import sys
import time


def ready(**info: object) -> None:
    print(json.dumps({"ready": True, **info}), flush=True)
    sys.stdin.readline()


def done(**info: object) -> None:
    print(json.dumps({"done": True, **info}), flush=True)
    sys.stdin.read()


def hold(name: str, timeout: float = 240.0) -> None:
    """Print a JSON line {"holding": name} and wait until the file $DASH_RELEASE_DIR/name exists (the test
    creates it once Prometheus has seen what is held), or `timeout` passes."""
    release = os.path.join(os.environ["DASH_RELEASE_DIR"], name)
    print(json.dumps({"holding": name}), flush=True)
    deadline = time.monotonic() + timeout
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)
