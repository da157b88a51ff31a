"""OTLP/JSON for spans, written straight from `ReadableSpan`s.

The protobuf route (the SDK's OTLP encoder, then protobuf's `MessageToDict`, then `json.dumps`)
costs about 100 µs per span here. Under a GIL, that CPU is taken from the host's threads by the
batch processor's export thread: it was most of the measured cost of instrumenting a
`/bin/true` spawn or a Nebius call against a loopback server. This encoder builds the same JSON
document from the span's own fields, in about a fifth of that. A test checks it field by field
against the protobuf route on spans with every kind of attribute, events, links, status and
parents. It covers opentelemetry-sdk 1.27 to 1.45, whose `ReadableSpan` API is stable.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

_KIND = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4, SpanKind.CONSUMER: 5}
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200


def _value(value: Any) -> dict[str, Any]:
    kind = type(value)  # the common exact types first (measured: 30-40 % cheaper than isinstance)
    if kind is str:
        return {"stringValue": value}
    if kind is float:
        return {"doubleValue": value}
    if kind is int:
        return {"intValue": str(value)}
    if kind is bool:
        return {"boolValue": value}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [_value(v) for v in value]} if value else {}}
    return {"stringValue": str(value)}


def _attributes(attributes: Any) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value(value)} for key, value in (attributes or {}).items()]


def _flags(other: Any) -> int:
    """OTLP span/link `flags`: whether the parent (or the linked span) is remote is known, and if so."""
    return _HAS_IS_REMOTE | (_IS_REMOTE if other is not None and other.is_remote else 0)


def _span(span: ReadableSpan) -> dict[str, Any]:
    # Each property once: on a ReadableSpan, `attributes`, `events` and `links` build a new view or
    # tuple per access.
    context = span.get_span_context()
    out: dict[str, Any] = {"traceId": f"{context.trace_id:032x}", "spanId": f"{context.span_id:016x}"}
    if context.trace_state:
        out["traceState"] = context.trace_state.to_header()
    parent = span.parent
    if parent is not None:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    out["name"] = span.name
    out["kind"] = _KIND.get(span.kind, 1)
    out["startTimeUnixNano"] = str(span.start_time or 0)
    out["endTimeUnixNano"] = str(span.end_time or 0)
    attributes = span.attributes
    if attributes:
        out["attributes"] = _attributes(attributes)
    if span.dropped_attributes:
        out["droppedAttributesCount"] = span.dropped_attributes
    span_events = span.events
    if span_events:
        events = []
        for event in span_events:
            item: dict[str, Any] = {"timeUnixNano": str(event.timestamp), "name": event.name}
            if event.attributes:
                item["attributes"] = _attributes(event.attributes)
            events.append(item)
        out["events"] = events
    if span.dropped_events:
        out["droppedEventsCount"] = span.dropped_events
    span_links = span.links
    if span_links:
        links = []
        for link in span_links:
            linked = link.context
            item = {"traceId": f"{linked.trace_id:032x}", "spanId": f"{linked.span_id:016x}"}
            if link.attributes:
                item["attributes"] = _attributes(link.attributes)
            item["flags"] = _flags(linked)
            links.append(item)
        out["links"] = links
    if span.dropped_links:
        out["droppedLinksCount"] = span.dropped_links
    status: dict[str, Any] = {}
    span_status = span.status
    if span_status.description:
        status["message"] = span_status.description
    if span_status.status_code is not StatusCode.UNSET:
        status["code"] = _STATUS[span_status.status_code]
    out["status"] = status
    out["flags"] = _flags(parent)
    return out


def _scope(scope: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if scope is None:
        return out
    if scope.name:
        out["name"] = scope.name
    if scope.version:
        out["version"] = scope.version
    attributes = getattr(scope, "attributes", None)
    if attributes:
        out["attributes"] = _attributes(attributes)
    return out


def encode_spans_json(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON `ExportTraceServiceRequest` line for `spans`, grouped by resource and scope."""
    by_resource: dict[int, tuple[Any, dict[int, tuple[Any, list[dict[str, Any]]]]]] = {}
    for span in spans:
        resource_entry = by_resource.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        resource_entry[1].setdefault(id(scope), (scope, []))[1].append(_span(span))
    resource_spans = []
    for resource, scopes in by_resource.values():
        scope_spans = []
        for scope, encoded in scopes.values():
            item: dict[str, Any] = {"scope": _scope(scope), "spans": encoded}
            if scope is not None and getattr(scope, "schema_url", ""):
                item["schemaUrl"] = scope.schema_url
            scope_spans.append(item)
        attributes = _attributes(resource.attributes) if resource is not None else []
        entry: dict[str, Any] = {"resource": {"attributes": attributes} if attributes else {}}
        entry["scopeSpans"] = scope_spans
        if resource is not None and resource.schema_url:
            entry["schemaUrl"] = resource.schema_url
        resource_spans.append(entry)
    return json.dumps({"resourceSpans": resource_spans} if resource_spans else {}, separators=(",", ":"))
