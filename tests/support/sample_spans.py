"""Finished spans for the encoder tests: SDK spans, and stallwatch's light spans as the processors get them."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from stallwatch.core import light_span


def sdk_spans() -> list:
    """Finished SDK spans of every kind, with links, events, statuses, a remote parent and two scopes."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "svc", "n": 2}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer, other = provider.get_tracer("x", "1.0"), provider.get_tracer("y")
    remote = SpanContext(
        0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")])
    )
    attributes = {"s": "é\n\"q\"", "i": 3, "neg": -7, "big": 2**62, "f": 1.5, "t": True, "l": ["x", "y"],
                  "li": [1, 2], "lb": [True, False], "lf": [0.5]}  # fmt: skip
    with tracer.start_as_current_span("parent"):
        child = tracer.start_span("child", kind=SpanKind.CLIENT, attributes=attributes, links=[Link(remote, {"w": 1})])
        child.add_event("event", {"k": 1})
        child.add_event("bare")
        child.set_status(Status(StatusCode.ERROR, "boom"))
        child.end()
        with other.start_as_current_span("server", kind=SpanKind.SERVER) as server:
            server.set_status(Status(StatusCode.OK))
        for kind in (SpanKind.PRODUCER, SpanKind.CONSUMER):
            tracer.start_span(kind.name, kind=kind).end()
    tracer.start_span("remote child", context=trace.set_span_in_context(trace.NonRecordingSpan(remote))).end()
    return list(exporter.get_finished_spans())


def light_spans() -> list:
    """Light spans as the processors get them (they are their own `ReadableSpan`): an executor-like
    item with its durations, one that other code changed in every way, a root client span with its
    own start, and one under a remote parent with a trace state."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}), span_limits=SpanLimits(max_events=1))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("stallwatch", "0.1")
    remote = SpanContext(0xAB, 0xCD, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    with tracer.start_as_current_span("request") as request:
        context = trace.set_span_in_context(request)
        item = light_span.start(tracer, "pool work item", context, {"stallwatch.executor.name": "pool"})
        item.set_own_attributes(
            {"stallwatch.executor.queue_seconds": 102933 / 1e9, "stallwatch.executor.run_seconds": 2.5e-05}
        )
        item.end()
        changed = light_span.start(tracer, "changed", context, {"a": 1})
        changed.set_attributes({"s": "x", "l": [1, 2]})
        changed.add_event("first", {"k": 1})
        changed.add_event("second")  # past max_events: the first is dropped, and counted
        changed.add_link(remote, {"why": "test"})
        changed.set_status(Status(StatusCode.ERROR, "boom"))
        changed.update_name("changed again")
        changed.end()
    light_span.start(tracer, "true", otel_context.Context(), {"process.pid": 7}, SpanKind.CLIENT, 1_000).end(2_000)
    light_span.start(tracer, "remote child", trace.set_span_in_context(trace.NonRecordingSpan(remote)), {}).end()
    spans = [span for span in exporter.get_finished_spans() if span.name != "request"]
    assert [type(span) for span in spans] == [light_span.LightSpan] * 4
    return spans
