"""The direct OTLP protobuf encoders (spans, log records) write the SDK encoders' bytes, and the
OTLP/HTTP exporters stallwatch builds send them."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from stallwatch.export import log_protobuf, span_protobuf
from support.fast_paths import fast_paths_on  # noqa: F401  # a fixture
from support.sample_logs import Bridge, log_batch
from support.sample_spans import light_spans, sdk_spans

# what the SDK's encoder writes differs across its versions; each test holds the fast path against it
pytestmark = [pytest.mark.matrix, pytest.mark.usefixtures("fast_paths_on")]


def _sdk_bytes(spans: list[Any]) -> bytes:
    return encode_spans(spans).SerializePartialToString()


def _span(name: str, resource: Resource, scope: InstrumentationScope | None, attributes: Any = None) -> ReadableSpan:
    context = SpanContext(0xABC, 0xDEF, is_remote=False, trace_flags=TraceFlags(1))
    return ReadableSpan(name=name, context=context, resource=resource, instrumentation_scope=scope,
                        attributes=attributes, start_time=1, end_time=2)  # fmt: skip


def test_it_is_used_exactly_where_it_writes_the_installed_sdks_bytes():
    probe = span_protobuf._probe()
    if span_protobuf.matches_sdk():
        assert span_protobuf.encode_spans_protobuf(probe) == _sdk_bytes(probe)
        assert span_protobuf.with_fast_encoding(OTLPSpanExporter) is not OTLPSpanExporter
    else:  # SDK 1.27 writes no scope schema URL: its own encoder stays
        assert span_protobuf.encode_spans_protobuf(probe) != _sdk_bytes(probe)
        assert span_protobuf.with_fast_encoding(OTLPSpanExporter) is OTLPSpanExporter


def test_sdk_made_spans_and_equal_resources_in_separate_objects_give_the_sdks_bytes():
    if not span_protobuf.matches_sdk():
        pytest.skip("this SDK's encoder writes otherwise (see the test above)")
    spans = sdk_spans()
    assert span_protobuf.encode_spans_protobuf(spans) == _sdk_bytes(spans)
    # Equal resources and scopes that are distinct objects, interleaved: grouped by equality, in order.
    first, same = Resource({"r": "x"}), Resource({"r": "x"})
    scope, same_scope, other = InstrumentationScope("s", "1"), InstrumentationScope("s", "1"), InstrumentationScope("o")
    batch = [_span("a", first, scope), _span("b", Resource({}), None), _span("c", same, same_scope),
             _span("d", same, other), _span("e", first, scope)]  # fmt: skip
    encoded = span_protobuf.encode_spans_protobuf(batch)
    assert encoded == _sdk_bytes(batch)
    request = ExportTraceServiceRequest.FromString(encoded)
    assert [[s.name for s in ss.spans] for rs in request.resource_spans for ss in rs.scope_spans] == [
        ["a", "c", "e"], ["d"], ["b"]
    ]  # fmt: skip


def test_light_spans_give_the_sdks_bytes():
    if not span_protobuf.matches_sdk():
        pytest.skip("this SDK's encoder writes otherwise (see the first test)")
    spans = light_spans()
    assert span_protobuf.encode_spans_protobuf(spans) == _sdk_bytes(spans)


@pytest.mark.parametrize(
    "value",
    [None, {"k": "v"}, "lone \ud800 surrogate", 2**64, [1, None], object()],
    ids=["none", "mapping", "surrogate", "int-overflow", "none-in-list", "object"],
)
def test_a_value_it_does_not_write_sends_the_whole_batch_to_the_sdks_encoder(value):
    resource = Resource({"service.name": "svc"})
    batch = [_span("plain", resource, None, {"k": "v"}), _span("odd", resource, None, {"odd": value, "k": 1})]
    with pytest.raises(span_protobuf._Unsupported):
        span_protobuf.encode_spans_protobuf(batch)
    calls = []

    def sdk(spans: Any) -> Any:
        calls.append(len(spans))
        return encode_spans(spans)

    try:
        expected = _sdk_bytes(batch)
    except Exception as error:  # what the SDK's encoder does with it is what happens
        with pytest.raises(type(error)):
            span_protobuf.fast_encoder(sdk)(batch).SerializePartialToString()
    else:
        assert span_protobuf.fast_encoder(sdk)(batch).SerializePartialToString() == expected
    assert calls == [2]


def test_a_failure_inside_the_writer_still_exports_the_batch_as_the_sdk_would(monkeypatch):
    def broken(span: Any) -> bytes:
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(span_protobuf, "_span", broken)
    spans = sdk_spans()
    assert span_protobuf.fast_encoder(encode_spans)(spans).SerializePartialToString() == _sdk_bytes(spans)


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.bodies.append((self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    bodies: list[tuple[str, bytes]] = []
    handler = type("Handler", (_Collector,), {"bodies": bodies})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/export", bodies
    finally:
        server.shutdown()
        server.server_close()


def test_kept_string_attributes_stay_bounded_and_give_the_sdks_bytes(monkeypatch):
    if not span_protobuf.matches_sdk():
        pytest.skip("this SDK's encoder writes otherwise (see the first test)")
    monkeypatch.setattr(span_protobuf, "_CACHE_LIMIT", 8)
    monkeypatch.setattr(span_protobuf, "_pairs", {})
    resource = Resource({"service.name": "svc"})
    long_value = "v" * (span_protobuf._CACHED_VALUE_CHARS + 1)
    batch = [
        _span(f"s{number}", resource, None, {f"key.{number}": f'é "{number}"', "same": "name", "long": long_value})
        for number in range(30)
        for _ in range(2)
    ]
    for _ in range(2):  # the second time from what the first left in the cache
        assert span_protobuf.encode_spans_protobuf(batch) == _sdk_bytes(batch)
        assert 0 < len(span_protobuf._pairs) <= 8
    assert all(value != long_value for _, value in span_protobuf._pairs)


# ---- log records ----------------------------------------------------------------------------------


def _log_bytes(batch: list[Any]) -> bytes:
    return encode_logs(batch).SerializeToString()


def test_log_records_give_the_sdks_bytes_or_go_to_the_sdks_encoder():
    probe = log_protobuf._probe()
    if log_protobuf.matches_sdk():
        assert log_protobuf.encode_logs_protobuf(probe) == _log_bytes(probe)
        assert log_protobuf.with_fast_encoding(OTLPLogExporter) is not OTLPLogExporter
    else:
        assert log_protobuf.with_fast_encoding(OTLPLogExporter) is OTLPLogExporter
    # test_log_json's batch: every body kind (mappings and None go to the SDK's encoder), exceptions,
    # spans, scopes, equal resources in separate objects.
    batch = log_batch()
    assert log_protobuf.fast_encoder(encode_logs)(batch).SerializeToString() == _log_bytes(batch)
    written = [item for item in batch if _writes(item)]
    assert len(written) >= 20  # all but mapping bodies and the like
    if log_protobuf.matches_sdk():
        assert log_protobuf.encode_logs_protobuf(written) == _log_bytes(written)


def _writes(item: Any) -> bool:
    try:
        log_protobuf.encode_logs_protobuf([item])
    except span_protobuf._Unsupported:
        return False
    return True


@pytest.mark.parametrize(
    ("body", "extra"),
    [("odd", {"big": 2**64}), ("odd", {"surrogate": "\ud800"}), ({"k": "v"}, {})],
    ids=["int-overflow", "surrogate", "mapping-body"],
)
def test_a_log_value_it_does_not_write_sends_the_whole_batch_to_the_sdks_encoder(body, extra):
    bridge = Bridge()
    bridge.provider("a", Resource({"service.name": "svc"}))
    logger = bridge.logger("a", "app")
    logger.info("plain")
    logger.info(body, extra=extra)
    batch = bridge.batch()
    with pytest.raises(span_protobuf._Unsupported):
        log_protobuf.encode_logs_protobuf(batch)
    try:
        expected = _log_bytes(batch)
    except Exception as error:
        with pytest.raises(type(error)):
            log_protobuf.fast_encoder(encode_logs)(batch).SerializeToString()
    else:
        assert log_protobuf.fast_encoder(encode_logs)(batch).SerializeToString() == expected


# ---- the exporters stallwatch builds ---------------------------------------------------------------

_SIGNALS = {  # signal: (encoder module, its function, SDK exporter class, SDK encoder, request class, batch)
    "traces": (span_protobuf, "encode_spans_protobuf", OTLPSpanExporter, encode_spans, ExportTraceServiceRequest,
               sdk_spans),
    "logs": (log_protobuf, "encode_logs_protobuf", OTLPLogExporter, encode_logs, ExportLogsServiceRequest,
             log_protobuf._probe),
}  # fmt: skip


@pytest.mark.parametrize("signal", sorted(_SIGNALS))
def test_the_http_exporter_stallwatch_builds_posts_the_encoders_bytes(collector, monkeypatch, signal):
    from stallwatch import pipeline
    from stallwatch.config import Settings

    module, function, exporter_class, sdk_encode, request_class, make_batch = _SIGNALS[signal]
    endpoint, bodies = collector
    monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", endpoint)
    fast = module.matches_sdk()  # before the spy: the check encodes a probe batch itself
    encoded: list[int] = []
    encode = getattr(module, function)

    def spy(batch: Any) -> bytes:
        encoded.append(len(batch))
        return encode(batch)

    monkeypatch.setattr(module, function, spy)
    exporter = pipeline._otlp_exporter(Settings.load(), signal)
    assert isinstance(exporter, exporter_class)
    batch = make_batch()
    try:
        exporter.export(batch)
    finally:
        exporter.shutdown()
    assert [content_type for content_type, _ in bodies] == ["application/x-protobuf"]
    assert request_class.FromString(bodies[0][1]) == sdk_encode(batch)
    assert encoded == ([len(batch)] if fast else [])
