"""OTLP/JSON for spans, written straight from `ReadableSpan`s.

The protobuf route (the SDK's OTLP encoder, then protobuf's `MessageToDict`, then `json.dumps`)
costs about 100 µs per span here. Under a GIL, that CPU is taken from the host's threads by the
batch processor's export thread: it was most of the measured cost of instrumenting a
`/bin/true` spawn or a Nebius call against a loopback server. This encoder builds the same JSON
document from the span's own fields, in about a fifth of that. A test checks it field by field
against the protobuf route on spans with every kind of attribute, events, links, status and
parents. It covers opentelemetry-sdk 1.27 to 1.45, whose `ReadableSpan` API is stable.

Each span is written as text (`_span_text`), not as a dict for `json.dumps`: an item span with
three attributes was ten dicts and lists, and every such container counts toward the garbage
collector's next run, which the host's threads pay for (measured: 1.8 to 5.4 µs of collection per
executor work item). Strings are escaped by `json`'s own C function, floats written as `json` writes
them, so the text is what `json.dumps` of the dict form gives. Events, links, a set status and
unusual attribute values (bytes, sequences, other types) still go through the dict form.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import DEFAULT_TRACE_STATE, SpanContext, SpanKind, StatusCode

_KIND = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4, SpanKind.CONSUMER: 5}
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_string: Any = json.encoder.encode_basestring_ascii  # what json.dumps uses for str
# A span's closing `flags`, by whether its parent is remote (`_flags`)
_FLAGS_END = {False: f',"flags":{_HAS_IS_REMOTE}}}', True: f',"flags":{_HAS_IS_REMOTE | _IS_REMOTE}}}'}
_KIND_BY_ID = {id(kind): number for kind, number in _KIND.items()}  # an enum member's hash is a Python call


# Span types whose `ReadableSpan` fields the encoders read directly: the SDK's finished span, and
# `core.light_span.LightSpan`, added by this package (this file imports nothing of stallwatch).
FIELD_READABLE: set[type] = {ReadableSpan}
_NONE_DROPPED = (0, 0, 0)


def dropped(collection: Any) -> int:
    """What an SDK `BoundedAttributes` or `BoundedList` dropped; 0 for anything else. The exact types
    are told first: `isinstance` of a plain dict or tuple against those ABCs takes 0.5 µs here."""
    kind = type(collection)
    if kind is BoundedAttributes or kind is BoundedList:
        return collection.dropped
    if kind is dict or kind is tuple or collection is None:
        return 0
    return collection.dropped if isinstance(collection, (BoundedAttributes, BoundedList)) else 0


def plain_attributes(attributes: Any) -> Any:
    """The dict inside an SDK `BoundedAttributes`, for the encoders to read; anything else as it is.

    A `BoundedAttributes` is a `MutableMapping` whose `items()`, iteration and `len()` go through
    Python methods and a lock: 1.95 µs against 0.33 µs to walk three attributes here. A finished
    span's or log record's attributes are immutable, so reading the dict directly is safe. (Here,
    not in the package: the executor benchmark loads this file alone.)
    """
    if type(attributes) is BoundedAttributes:
        return getattr(attributes, "_dict", attributes)
    return attributes


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


def _float_text(value: float) -> str:
    return float.__repr__(value) if math.isfinite(value) else json.dumps(value)  # NaN, Infinity as json writes


def _value_text(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return '{"stringValue":' + _string(value) + "}"
    if kind is float:
        return '{"doubleValue":' + _float_text(value) + "}"
    if kind is int:
        return '{"intValue":"' + int.__repr__(value) + '"}'
    if kind is bool:
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    return json.dumps(_value(value), separators=(",", ":"))


# Attribute keys, and most string values (executor, executable and method names, statuses), repeat
# from span to span: their escaped text is kept. Each cache is emptied when it reaches its limit, so
# values that never repeat (ids) cost one insert each and the memory stays bounded.
_CACHE_LIMIT = 4096
_CACHED_VALUE_CHARS = 64
_key_texts: dict[str, str] = {}
_string_texts: dict[str, str] = {}


def _kept(cache: dict[str, str], key: str, text: str) -> str:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = text
    return text


def _key_text(key: str) -> str:
    """`{"key":<key>,"value":`, kept."""
    return _key_texts.get(key) or _kept(_key_texts, key, '{"key":' + _string(key) + ',"value":')


def _string_text(value: str) -> str:
    """`{"stringValue":<value>}}`, the attribute's closing brace included; kept if short."""
    text = '{"stringValue":' + _string(value) + "}}"
    return _kept(_string_texts, value, text) if len(value) <= _CACHED_VALUE_CHARS else text


def _attributes_text(attributes: Any) -> str:
    parts = []
    for key, value in attributes.items():
        key_text = _key_texts.get(key) or _key_text(key)
        kind = type(value)
        if kind is str:
            parts.append(key_text + (_string_texts.get(value) or _string_text(value)))
        elif kind is float and value - value == 0.0:  # finite (inf - inf and NaN - NaN are NaN)
            parts.append(f'{key_text}{{"doubleValue":{value!r}}}}}')
        elif kind is int:
            parts.append(f'{key_text}{{"intValue":"{value}"}}}}')
        else:
            parts.append(key_text + _value_text(value) + "}")
    return ",".join(parts)


def _span_text(span: ReadableSpan) -> str:
    """One OTLP/JSON span, written as text (see the module docstring). The SDK's `ReadableSpan` is
    read through its private fields, the same from SDK 1.27 to 1.45 (its properties are a Python
    call each, and `attributes`, `events` and `links` build a new view or tuple per access)."""
    if type(span) in FIELD_READABLE:  # its fields, read without the properties
        context, parent, name, kind = span._context, span._parent, span._name, span._kind
        start, end, attributes, span_events, span_links = (
            span._start_time, span._end_time, span._attributes, span._events, span._links,
        )  # fmt: skip
        span_status = span._status
        if type(attributes) is dict and type(span_events) is tuple and type(span_links) is tuple:
            counts = _NONE_DROPPED  # a light span's, with nothing set on it by other code
        else:
            counts = (dropped(attributes), dropped(span_events), dropped(span_links))
    else:
        context, parent, name, kind = span.get_span_context(), span.parent, span.name, span.kind
        start, end, attributes, span_events, span_links = (
            span.start_time, span.end_time, span.attributes, span.events, span.links,
        )  # fmt: skip
        span_status = span.status
        counts = (span.dropped_attributes, span.dropped_events, span.dropped_links)
    attributes = plain_attributes(attributes)  # read once here, for `if attributes` and the walk
    if type(context) is SpanContext:  # the tuple unpacked at once, not through its properties
        trace_id, span_id, _, _, trace_state, _ = context
    elif context is None:  # no exported span lacks one; the SDK's encoder cannot write it either
        raise ValueError(f"the span {name!r} has no span context")
    else:
        trace_id, span_id, trace_state = context.trace_id, context.span_id, context.trace_state
    parts = [
        '{"traceId":"' + trace_id.to_bytes(16, "big").hex() + '","spanId":"' + span_id.to_bytes(8, "big").hex() + '"'
    ]
    if trace_state is not DEFAULT_TRACE_STATE and trace_state:  # the shared empty one, told without its len()
        parts.append(',"traceState":' + _string(trace_state.to_header()))
    remote = False
    if parent is not None:
        if type(parent) is SpanContext:
            _, parent_id, remote, _, _, _ = parent
        else:
            parent_id, remote = parent.span_id, parent.is_remote
        parts.append(',"parentSpanId":"' + parent_id.to_bytes(8, "big").hex() + '"')
    parts.append(
        f',"name":{_string(name)},"kind":{_KIND_BY_ID.get(id(kind), 1)}'
        f',"startTimeUnixNano":"{start or 0}","endTimeUnixNano":"{end or 0}"'
    )
    if attributes:
        parts.append(',"attributes":[' + _attributes_text(attributes) + "]")
    if counts[0]:
        parts.append(f',"droppedAttributesCount":{counts[0]}')
    if span_events:
        events = []
        for event in span_events:
            item: dict[str, Any] = {"timeUnixNano": str(event.timestamp), "name": event.name}
            if event.attributes:
                item["attributes"] = _attributes(event.attributes)
            events.append(item)
        parts.append(',"events":' + json.dumps(events, separators=(",", ":")))
    if counts[1]:
        parts.append(f',"droppedEventsCount":{counts[1]}')
    if span_links:
        links = []
        for link in span_links:
            linked = link.context
            entry: dict[str, Any] = {
                "traceId": linked.trace_id.to_bytes(16, "big").hex(),
                "spanId": linked.span_id.to_bytes(8, "big").hex(),
            }
            if link.attributes:
                entry["attributes"] = _attributes(link.attributes)
            entry["flags"] = _flags(linked)
            links.append(entry)
        parts.append(',"links":' + json.dumps(links, separators=(",", ":")))
    if counts[2]:
        parts.append(f',"droppedLinksCount":{counts[2]}')
    if span_status.description or span_status.status_code is not StatusCode.UNSET:
        status: dict[str, Any] = {}
        if span_status.description:
            status["message"] = span_status.description
        if span_status.status_code is not StatusCode.UNSET:
            status["code"] = _STATUS[span_status.status_code]
        parts.append(',"status":' + json.dumps(status, separators=(",", ":")))
    else:
        parts.append(',"status":{}')
    parts.append(_FLAGS_END[bool(remote)])
    return "".join(parts)


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
    by_resource: dict[int, tuple[Any, dict[int, tuple[Any, list[str]]]]] = {}
    for span in spans:
        exact = type(span) in FIELD_READABLE
        resource = span._resource if exact else span.resource
        resource_entry = by_resource.get(id(resource))
        if resource_entry is None:
            resource_entry = by_resource[id(resource)] = (resource, {})
        scope = span._instrumentation_scope if exact else span.instrumentation_scope
        scope_entry = resource_entry[1].get(id(scope))
        if scope_entry is None:
            scope_entry = resource_entry[1][id(scope)] = (scope, [])
        scope_entry[1].append(_span_text(span))
    if not by_resource:
        return "{}"
    # The document's pieces, joined once: a batch of 512 spans is about 300 kB of text, which
    # nested concatenations copied six times (2.7 µs per span beside 12 µs to write it, measured)
    compact: dict[str, Any] = {"separators": (",", ":")}
    pieces = ['{"resourceSpans":[']
    for resource_number, (resource, scopes) in enumerate(by_resource.values()):
        attributes = _attributes(resource.attributes) if resource is not None else []
        pieces.append(
            ("," if resource_number else "")
            + '{"resource":'
            + json.dumps({"attributes": attributes} if attributes else {}, **compact)
            + ',"scopeSpans":['
        )
        for scope_number, (scope, encoded) in enumerate(scopes.values()):
            pieces.append(
                ("," if scope_number else "") + '{"scope":' + json.dumps(_scope(scope), **compact) + ',"spans":['
            )
            pieces.append(",".join(encoded))
            schema = getattr(scope, "schema_url", "") if scope is not None else ""
            pieces.append(f'],"schemaUrl":{_string(schema)}}}' if schema else "]}")
        schema = resource.schema_url if resource is not None else ""
        pieces.append(f'],"schemaUrl":{_string(schema)}}}' if schema else "]}")
    pieces.append("]}")
    return "".join(pieces)
