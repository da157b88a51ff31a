"""Misbehaving OTLP collectors on loopback, for tests/test_reliability.py and the backend-faults benchmark.

Faults (`FAULTS`), each for OTLP/HTTP (`http`) and OTLP/gRPC (`grpc`):

- `refuse`: nothing listens; every connection is refused (the port stays bound, so no one else gets it).
- `silent`: accepts connections and never answers (gRPC: the call never completes until the client gives up).
- `slow`: answers every request with success after `SLOW_SECONDS`.
- `error`: answers every request with HTTP 503 / gRPC `UNAVAILABLE`.

And `healthy` (HTTP only), which answers success at once: the benchmark's reference for what
exporting itself costs.

In a test, `with serve(fault, protocol) as endpoint:` runs one on threads of the calling process; as a
script, `python reliability_collectors.py FAULT PROTOCOL` serves one in its own process and prints
its endpoint on the first stdout line, until killed (the benchmark does that, so the collector's
work does not run in the measured host).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("refuse", "silent", "slow", "error")
SLOW_SECONDS = 2.0
_OTLP_METHODS = (
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
    "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
)


@contextlib.contextmanager
def _refusing() -> Iterator[str]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound but not listening: connect() gets ECONNREFUSED
    try:
        yield f"http://127.0.0.1:{held.getsockname()[1]}"
    finally:
        held.close()


@contextlib.contextmanager
def _silent_tcp() -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    held: list[socket.socket] = []

    def accept_and_hold() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            held.append(connection)

    threading.Thread(target=accept_and_hold, name="silent-collector", daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for connection in held:
            connection.close()


class _Handler(BaseHTTPRequestHandler):
    status = 200
    delay = 0.0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(self.delay)
        self.send_response(self.status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _http(status: int, delay: float) -> Iterator[str]:
    handler = type("Handler", (_Handler,), {"status": status, "delay": delay})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http-collector", daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _grpc(fault: str) -> Iterator[str]:
    import grpc

    stopping = threading.Event()

    def export(request: bytes, context: grpc.ServicerContext) -> bytes:
        if fault == "error":
            context.abort(grpc.StatusCode.UNAVAILABLE, "collector unavailable")
        if fault == "silent":
            while context.is_active() and not stopping.wait(0.05):
                pass
        else:
            time.sleep(SLOW_SECONDS)
        return b""  # an empty Export*ServiceResponse: success

    handler = grpc.unary_unary_rpc_method_handler(export)  # raw bytes in and out
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers([_Generic({method: handler for method in _OTLP_METHODS})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stopping.set()
        server.stop(grace=None)


class _Generic:
    """A grpc generic handler answering the three OTLP Export methods by full method name."""

    def __init__(self, handlers: dict[str, object]) -> None:
        self.handlers = handlers

    def service(self, details: object) -> object:
        return self.handlers.get(details.method)  # type: ignore[attr-defined]


@contextlib.contextmanager
def serve(fault: str, protocol: str = "http") -> Iterator[str]:
    """Run one misbehaving collector; yields its OTLP endpoint (base URL)."""
    if fault == "refuse":
        with _refusing() as endpoint:
            yield endpoint
    elif protocol == "grpc":
        with _grpc(fault) as endpoint:
            yield endpoint
    elif fault == "silent":
        with _silent_tcp() as endpoint:
            yield endpoint
    elif fault in ("slow", "healthy"):
        with _http(200, SLOW_SECONDS if fault == "slow" else 0.0) as endpoint:
            yield endpoint
    else:
        with _http(503, 0.0) as endpoint:
            yield endpoint


if __name__ == "__main__":
    with serve(sys.argv[1], sys.argv[2]) as url:
        print(url, flush=True)
        threading.Event().wait()
