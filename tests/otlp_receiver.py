"""A real OTLP/HTTP receiver on loopback, as a pytest fixture (`receiver`), with decoders."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint on 127.0.0.1 that records every request it answers."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ReceiverHandler)
        self.requests: list[tuple[str, bytes]] = []

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
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def otlp_spans(receiver: Receiver) -> list:
    """Every span the receiver got on /v1/traces (protobuf Span objects)."""
    return [
        span
        for body in receiver.bodies("/v1/traces")
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]


def otlp_metric_names(receiver: Receiver) -> set[str]:
    """Names of every metric the receiver got on /v1/metrics."""
    return {
        metric.name
        for body in receiver.bodies("/v1/metrics")
        for rm in ExportMetricsServiceRequest.FromString(body).resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    }


_SIGNALS = {
    "spans": ("/v1/traces", ExportTraceServiceRequest, "resource_spans", "scope_spans", "spans"),
    "metrics": ("/v1/metrics", ExportMetricsServiceRequest, "resource_metrics", "scope_metrics", "metrics"),
    "logs": ("/v1/logs", ExportLogsServiceRequest, "resource_logs", "scope_logs", "log_records"),
}


def otlp_received(receiver: Receiver, kind: str) -> list[tuple[dict[str, str], str, Any]]:
    """Every span, metric or log record (`kind`) the receiver got, each with its resource's string
    attributes and its instrumentation scope's name: which process and which provider sent it."""
    path, request_type, resources, scopes, items = _SIGNALS[kind]
    received = []
    for body in receiver.bodies(path):
        for resource in getattr(request_type.FromString(body), resources):
            attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scope in getattr(resource, scopes):
                received.extend((attributes, scope.scope.name, item) for item in getattr(scope, items))
    return received
