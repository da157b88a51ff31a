"""A Sentry ingestion endpoint on loopback: the real sentry-sdk sends its envelopes here over HTTP.

`SentrySink.dsn` is a DSN for `sentry_sdk.init`; every envelope the SDK posts (gzip or plain) is
parsed into its items. Nothing leaves the machine.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def parse_envelope(body: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """The (item header, payload) pairs of one envelope (the envelope's own header is skipped)."""
    items = []
    _, _, rest = body.partition(b"\n")
    while rest.strip():
        header_line, _, rest = rest.partition(b"\n")
        header = json.loads(header_line)
        if "length" in header:
            payload, rest = rest[: header["length"]], rest[header["length"] + 1 :]
        else:
            payload, _, rest = rest.partition(b"\n")
        items.append((header, payload))
    return items


class SentrySink(ThreadingHTTPServer):
    """Answers `POST /api/<project>/envelope/` like Sentry and keeps every item it received."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.items: list[tuple[dict[str, Any], bytes]] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def dsn(self) -> str:
        return f"http://publickey@127.0.0.1:{self.server_address[1]}/1"

    def start(self) -> SentrySink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def received(self, items: list[tuple[dict[str, Any], bytes]]) -> None:
        with self._changed:
            self.items += items
            self._changed.notify_all()

    def events(self) -> list[dict[str, Any]]:
        """Every error/message event received so far (not sessions, client reports, ...)."""
        with self._changed:
            return [json.loads(payload) for header, payload in self.items if header.get("type") == "event"]

    def wait_for_events(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 30
    ) -> list[dict[str, Any]]:
        """The events received once `predicate(events)` holds; AssertionError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                events = self.events()
                if predicate(events):
                    return events
                left = deadline - time.monotonic()
                if left <= 0:
                    titles = [e.get("message") or e.get("logentry", {}).get("message") for e in events]
                    raise AssertionError(f"the Sentry sink did not receive the expected events; it has {titles}")
                self._changed.wait(min(left, 0.5))


class _Handler(BaseHTTPRequestHandler):
    server: SentrySink

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.received(parse_envelope(body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass
