"""The direct span encoder writes what the SDK's OTLP encoder + protobuf's JSON printer write."""

from __future__ import annotations

import json

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, TraceFlags

from stallwatch.export.otlp_json import to_otlp_json
from stallwatch.export.span_json import encode_spans_json
from support.sample_spans import light_spans, sdk_spans

pytestmark = pytest.mark.matrix  # the protobuf route differs across SDK versions


def _flatten(document: dict, keep_flags: bool) -> list[tuple[str, str, str]]:
    rows = []
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                if not keep_flags:
                    span.pop("flags", None)
                    for link in span.get("links", []):
                        link.pop("flags", None)
                rows.append(tuple(json.dumps(x, sort_keys=True) for x in (resource_spans["resource"],
                                                                          scope_spans["scope"], span)))  # fmt: skip
    return sorted(rows)


@pytest.mark.parametrize(("make", "count"), [(sdk_spans, 6), (light_spans, 4)], ids=["sdk_spans", "light_spans"])
def test_the_direct_encoder_matches_the_protobuf_route_field_by_field(make, count):
    """Light spans are read through their own fields (`FIELD_READABLE`); the SDK's encoder reads
    their properties."""
    spans = make()
    reference = json.loads(to_otlp_json(encode_spans(spans)))
    ours = json.loads(encode_spans_json(spans))
    # Older SDK encoders write no `flags`; compare them only where the reference has them.
    keep_flags = '"flags"' in json.dumps(reference)
    assert _flatten(ours, keep_flags) == _flatten(reference, keep_flags)
    assert len(_flatten(ours, keep_flags)) == count


def test_empty_values_resources_and_batches_are_written_as_protobuf_writes_them():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.get_empty())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("x").start_span("empty values", attributes={"none": [], "s": ""}).end()
    spans = list(exporter.get_finished_spans())
    assert json.loads(encode_spans_json(spans)) == json.loads(to_otlp_json(encode_spans(spans)))
    assert encode_spans_json([]) == to_otlp_json(encode_spans([]))


class _OtherReadableSpan(ReadableSpan):
    """A ReadableSpan subclass: the encoder reads it through the public properties."""


def test_spans_of_other_types_are_read_through_their_properties_with_the_same_result():
    spans = sdk_spans()
    others = []
    for span in spans:
        other = object.__new__(_OtherReadableSpan)
        other.__dict__.update(span.__dict__)
        others.append(other)
    assert encode_spans_json(others) == encode_spans_json(spans)
    assert '"droppedAttributesCount"' not in encode_spans_json(others)


def test_dropped_attribute_event_and_link_counts_are_written_as_protobuf_writes_them():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(span_limits=SpanLimits(max_span_attributes=1, max_events=1, max_links=1))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    links = [Link(SpanContext(0x12, 0x34, is_remote=False, trace_flags=TraceFlags(1))) for _ in range(3)]
    span = provider.get_tracer("x").start_span("limited", attributes={"a": 1, "b": 2, "c": 3}, links=links)
    span.add_event("one")
    span.add_event("two")
    span.end()
    spans = list(exporter.get_finished_spans())
    ours = encode_spans_json(spans)
    assert json.loads(ours) == json.loads(to_otlp_json(encode_spans(spans)))
    assert '"droppedAttributesCount":2' in ours and '"droppedEventsCount":1' in ours and '"droppedLinksCount":2' in ours


def test_cached_key_and_value_texts_stay_bounded_and_write_what_the_protobuf_route_writes(monkeypatch):
    from stallwatch.export import span_json

    monkeypatch.setattr(span_json, "_CACHE_LIMIT", 8)
    monkeypatch.setattr(span_json, "_key_texts", {})
    monkeypatch.setattr(span_json, "_string_texts", {})
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("x")
    long_value = "v" * (span_json._CACHED_VALUE_CHARS + 1)
    for number in range(30):  # more distinct keys and values than the caches hold, each twice
        attributes = {f"key.{number}": f'é "{number}"', "same": "name", "long": long_value, "n": number}
        for _ in range(2):
            tracer.start_span(f"s{number}", attributes=attributes).end()
    spans = list(exporter.get_finished_spans())
    for batch in (spans, spans):  # the second time, from what the first left in the caches
        reference = json.loads(to_otlp_json(encode_spans(batch)))
        keep_flags = '"flags"' in json.dumps(reference)
        assert _flatten(json.loads(encode_spans_json(batch)), keep_flags) == _flatten(reference, keep_flags)
        assert 0 < len(span_json._key_texts) <= 8
        assert 0 < len(span_json._string_texts) <= 8
    assert long_value not in span_json._string_texts


def test_numbers_take_the_fast_path_only_where_it_writes_what_the_general_one_writes():
    from stallwatch.export import span_json

    values = {
        "f": 0.1, "tiny": 5e-324, "neg": -2.5, "zero": -0.0, "nan": float("nan"), "inf": float("inf"),
        "-inf": float("-inf"), "i": 0, "big": 2**63 - 1, "huge": 2**70, "t": True, "f0": False,
    }  # fmt: skip
    general = ",".join(span_json._key_text(key) + span_json._value_text(value) + "}" for key, value in values.items())

    text = span_json._attributes_text(values)

    assert text == general
    parsed = json.loads("[" + text + "]")  # the non-finite ones as json.dumps writes them (NaN, Infinity)
    assert [entry["key"] for entry in parsed] == list(values)


def test_the_encoder_loads_from_its_file_alone_as_the_executor_benchmark_loads_it():
    """`tests/bench/bench_executor.py` gives its stallwatch-free traced baseline this same encoder by
    loading `span_json.py` outside the package, so the file must import nothing of stallwatch."""
    import importlib.util
    from pathlib import Path

    import stallwatch.export.span_json as packaged

    spec = importlib.util.spec_from_file_location("standalone_span_json", Path(packaged.__file__))
    assert spec is not None and spec.loader is not None
    standalone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standalone)
    spans = sdk_spans()
    assert standalone.encode_spans_json(spans) == encode_spans_json(spans)
