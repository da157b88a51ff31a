"""A loopback OTLP/HTTP collector that keeps each request's path and body."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Collector(http.server.BaseHTTPRequestHandler):
    requests: list[tuple[str, bytes]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


@contextmanager
def otlp_http_collector() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """(base endpoint, the (path, body) of every request taken so far) while it serves."""
    requests: list[tuple[str, bytes]] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Collector,), {"requests": requests}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
