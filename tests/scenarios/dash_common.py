"""Shared protocol of the dash_*.py scenarios that tests/test_dashboards.py runs under a real Prometheus.

A scenario sets stallwatch up (OTEL_METRICS_EXPORTER=prometheus and the ports come from the
environment), prints a JSON line with "ready", waits for a line on stdin (Prometheus scrapes it by
then), does its work, prints a JSON line with "done" and keeps serving its metrics until stdin closes.
"""

import json
import sys


def ready(**info: object) -> None:
    print(json.dumps({"ready": True, **info}), flush=True)
    sys.stdin.readline()


def done(**info: object) -> None:
    print(json.dumps({"done": True, **info}), flush=True)
    sys.stdin.read()
