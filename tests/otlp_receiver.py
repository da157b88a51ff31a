"""A real OTLP/HTTP receiver on loopback, as a pytest fixture (`receiver`), with decoders."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint on 127.0.0.1 that records every request it answers, on receipt. It answers
    400 (an error the exporters do not retry) at once to the first `refused[path]` requests on a path,
    and 200 to the others, after `slow[path]` seconds."""

    def __init__(self, refused: Mapping[str, int] = {}, slow: Mapping[str, float] = {}) -> None:
        super().__init__(("127.0.0.1", 0), ReceiverHandler)
        self.requests: list[tuple[str, bytes]] = []
        self.refused = dict(refused)
        self.slow = slow
        self.lock = threading.Lock()  # the handlers' threads count the refusals

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def bodies(self, path: str) -> list[bytes]:
        return [body for request_path, body in self.requests if request_path == path]


class ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append((self.path, body))
        with self.server.lock:
            refused = self.server.refused.get(self.path, 0)
            self.server.refused[self.path] = refused - 1
        if refused <= 0:
            time.sleep(self.server.slow.get(self.path, 0.0))
        self.send_response(400 if refused > 0 else 200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serving(refused: Mapping[str, int] = {}, slow: Mapping[str, float] = {}) -> Iterator[Receiver]:
    """A `Receiver` answering on its own thread until the block ends."""
    server = Receiver(refused, slow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serving() as server:
        yield server


_SIGNALS = {  # path: the request, and the attributes that lead from it to the items
    "/v1/traces": (ExportTraceServiceRequest, "resource_spans", "scope_spans", "spans"),
    "/v1/metrics": (ExportMetricsServiceRequest, "resource_metrics", "scope_metrics", "metrics"),
    "/v1/logs": (ExportLogsServiceRequest, "resource_logs", "scope_logs", "log_records"),
}


def otlp_received(receiver: Receiver, path: str) -> list:
    """Every item the receiver got on `path` (/v1/traces, /v1/metrics or /v1/logs), in the order received:
    protobuf Span, Metric or LogRecord objects."""
    return [item for _, _, item in otlp_received_from(receiver, path)]


def otlp_received_from(receiver: Receiver, path: str) -> list[tuple[dict[str, str], str, Any]]:
    """Every item the receiver got on `path`, each with its resource's string attributes and its
    instrumentation scope's name: which process and which provider sent it."""
    request, resources, scopes, items = _SIGNALS[path]
    received = []
    for body in receiver.bodies(path):
        for resource in getattr(request.FromString(body), resources):
            attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scope in getattr(resource, scopes):
                received.extend((attributes, scope.scope.name, item) for item in getattr(scope, items))
    return received


def otlp_batches(receiver: Receiver, path: str) -> list[list]:
    """The items of each request the receiver got on `path`, one list per request, in the order received."""
    request, resources, scopes, items = _SIGNALS[path]
    return [
        [item for resource in getattr(request.FromString(body), resources)
         for scope in getattr(resource, scopes) for item in getattr(scope, items)]
        for body in receiver.bodies(path)
    ]  # fmt: skip


def otlp_spans(receiver: Receiver) -> list:
    """Every span the receiver got on /v1/traces (protobuf Span objects)."""
    return otlp_received(receiver, "/v1/traces")


def otlp_logs(receiver: Receiver) -> list:
    """Every log record the receiver got on /v1/logs (protobuf LogRecord objects)."""
    return otlp_received(receiver, "/v1/logs")


def otlp_metric_names(receiver: Receiver) -> set[str]:
    """Names of every metric the receiver got on /v1/metrics."""
    return {metric.name for metric in otlp_received(receiver, "/v1/metrics")}


def otlp_gauge_points(receiver: Receiver, name: str) -> list:
    """Every data point of the gauge `name` the receiver got, in the order received."""
    return [
        point
        for metric in otlp_received(receiver, "/v1/metrics")
        if metric.name == name
        for point in metric.gauge.data_points
    ]


def otlp_attributes(item: object) -> dict[str, object]:
    """The attributes of a protobuf span, log record or data point as a dict (None for an empty value)."""
    values = {}
    for attribute in item.attributes:  # type: ignore[attr-defined]
        kind = attribute.value.WhichOneof("value")
        values[attribute.key] = getattr(attribute.value, kind) if kind else None
    return values
