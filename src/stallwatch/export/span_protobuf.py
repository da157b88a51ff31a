"""OTLP protobuf for spans, written straight from `ReadableSpan`s, for the OTLP/HTTP span exporter.

The SDK's encoder builds a protobuf object for every span, attribute, event and link from Python, on
the batch processor's export thread but under the host's GIL. This module writes the same bytes with
`struct` and byte joins, field by field in the order protobuf writes them (what that saves:
`tests/bench/results/fast_paths.md`).

It is used only where it writes exactly what the installed SDK writes: `matches_sdk()` encodes a
probe batch both ways (every attribute type, empty values, events, links, statuses, local and
remote parents, a trace state, two resources and scopes) and compares the bytes; on any
difference (another SDK version) the SDK's encoder stays. A batch holding a value this module does
not write (None, mappings, text that is not UTF-8, integers past 64 bits, other types), or on which
it fails in any other way, goes to the SDK's encoder whole, which then does what it always does.
"""

from __future__ import annotations

import struct
import types
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from .span_json import FIELD_READABLE, plain_attributes
from .span_json import dropped as span_dropped

_INT64 = 2**63
_KIND = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4, SpanKind.CONSUMER: 5}
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_double = struct.Struct("<d").pack
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_FLAGS_FIELD = b"\x85\x01"  # Span.flags: field 16, fixed32
_SMALL = [bytes([n]) for n in range(128)]


class _Unsupported(Exception):
    """A value this module does not write as the SDK's encoder does."""


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value]
    out = bytearray()
    while value > 127:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + _varint(len(payload)) + payload


def _text(value: Any) -> bytes:
    if type(value) is not str:
        raise _Unsupported
    try:
        return value.encode()
    except UnicodeEncodeError:
        raise _Unsupported from None


def _any_value(value: Any) -> bytes:
    """An `AnyValue`: one member of its oneof, written even when it holds the default."""
    kind = type(value)
    if kind is str:
        return _field(b"\x0a", _text(value))
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        if not -_INT64 <= value < _INT64:
            raise _Unsupported
        return b"\x18" + _varint(value if value >= 0 else value + 2**64)
    if kind is float:
        return b"\x21" + _double(value)
    if kind is bytes:
        return _field(b"\x3a", value)
    if kind is list or kind is tuple:
        return _field(b"\x2a", b"".join([_field(b"\x0a", _any_value(item)) for item in value]))
    raise _Unsupported


# A `KeyValue` whose value is a short string (executor, executable and method names, statuses) repeats
# from span to span: its bytes are kept, in a cache emptied when it reaches its limit, so values that
# never repeat (ids) cost one insert each and the memory stays bounded.
_CACHE_LIMIT = 4096
_CACHED_VALUE_CHARS = 64
_pairs: dict[tuple[str, str], bytes] = {}


def _key_value(key: Any, value: Any) -> bytes:
    return _field(b"\x0a", _text(key)) + _field(b"\x12", _any_value(value))


def _string_pair(key: str, value: str) -> bytes:
    pair = _key_value(key, value)
    if len(value) <= _CACHED_VALUE_CHARS:
        if len(_pairs) >= _CACHE_LIMIT:
            _pairs.clear()
        _pairs[key, value] = pair
    return pair


def _attributes(tag: bytes, attributes: Any) -> bytes:
    attributes = plain_attributes(attributes)
    if not attributes:
        return b""
    parts = []
    for key, value in attributes.items():
        if type(value) is str and type(key) is str:
            pair = _pairs.get((key, value)) or _string_pair(key, value)
        else:
            pair = _key_value(key, value)
        parts.append(_field(tag, pair))
    return b"".join(parts)


def _count(tag: bytes, value: int) -> bytes:
    return tag + _varint(value) if value else b""


def _flags(other: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if other is not None and other.is_remote else 0)


def _span(span: ReadableSpan) -> bytes:
    if type(span) in FIELD_READABLE:  # its fields, read without the properties (see `span_json`)
        context, parent, name, kind = span._context, span._parent, span._name, span._kind
        start, end, attributes, events, links = (
            span._start_time, span._end_time, span._attributes, span._events, span._links,
        )  # fmt: skip
        status = span._status
        dropped = (span_dropped(attributes), span_dropped(events), span_dropped(links))
    else:
        context, parent, name, kind = span.get_span_context(), span.parent, span.name, span.kind
        start, end, attributes, events, links = span.start_time, span.end_time, span.attributes, span.events, span.links
        status = span.status
        dropped = (span.dropped_attributes, span.dropped_events, span.dropped_links)
    if context is None:  # no exported span lacks one; the SDK's encoder cannot write it either
        raise _Unsupported
    parts = [b"\x0a\x10" + context.trace_id.to_bytes(16, "big"), b"\x12\x08" + context.span_id.to_bytes(8, "big")]
    if context.trace_state is not None:
        state = ",".join([f"{key}={value}" for key, value in context.trace_state.items()])
        if state:
            parts.append(_field(b"\x1a", _text(state)))
    if parent:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    if name:
        parts.append(_field(b"\x2a", _text(name)))
    parts.append(b"\x30" + _SMALL[_KIND[kind]])
    if start:
        parts.append(b"\x39" + _fixed64(start))
    if end:
        parts.append(b"\x41" + _fixed64(end))
    parts.append(_attributes(b"\x4a", attributes))
    parts.append(_count(b"\x50", dropped[0]))
    for event in events or ():
        body = b"\x09" + _fixed64(event.timestamp) if event.timestamp else b""
        if event.name:
            body += _field(b"\x12", _text(event.name))
        body += _attributes(b"\x1a", event.attributes) + _count(b"\x20", event.dropped_attributes)
        parts.append(_field(b"\x5a", body))
    parts.append(_count(b"\x60", dropped[1]))
    for link in links or ():
        linked = link.context
        body = b"\x0a\x10" + linked.trace_id.to_bytes(16, "big") + b"\x12\x08" + linked.span_id.to_bytes(8, "big")
        body += _attributes(b"\x22", link.attributes) + _count(b"\x28", link.dropped_attributes)
        body += b"\x35" + _fixed32(_flags(linked))
        parts.append(_field(b"\x6a", body))
    parts.append(_count(b"\x70", dropped[2]))
    if status is not None:
        body = _field(b"\x12", _text(status.description)) if status.description else b""
        body += _count(b"\x18", status.status_code.value)
        parts.append(_field(b"\x7a", body))
    parts.append(_FLAGS_FIELD + _fixed32(_flags(parent)))
    return b"".join(parts)


def _scope(scope: InstrumentationScope | None) -> bytes:
    if scope is None:
        return b""
    body = _field(b"\x0a", _text(scope.name)) if scope.name else b""
    if scope.version:
        body += _field(b"\x12", _text(scope.version))
    return body + _attributes(b"\x1a", getattr(scope, "attributes", None))


def _group(key: Any, canonical: dict[int, list[Any]], groups: list[tuple[Any, Any]], new: Callable[[], Any]) -> Any:
    """The group of `key`: the first group whose key equals it (as the SDK's encoder groups, by
    equality and in order of first appearance), looked up by `id` after the first time."""
    found = canonical.get(id(key))
    if found is None:
        for known, group in groups:
            if known == key:
                found = [group]
                break
        else:
            found = [new()]
            groups.append((key, found[0]))
        canonical[id(key)] = found
    return found[0]


def request(items: Iterable[tuple[Any, Any, bytes]]) -> bytes:
    """A serialized export request (`ExportTraceServiceRequest` or `ExportLogsServiceRequest`: the
    same layout) of (resource, scope or None, encoded item) triples, grouped by resource and scope as
    the SDK's encoders group them."""
    resources: list[tuple[Any, tuple[list[tuple[Any, list[bytes]]], dict[int, list[Any]]]]] = []
    canonical: dict[int, list[Any]] = {}
    for resource, scope, encoded in items:
        scopes, by_id = _group(resource, canonical, resources, lambda: ([], {}))
        _group(scope, by_id, scopes, list).append(encoded)
    out = []
    for resource, (scopes, _) in resources:
        body = _field(b"\x0a", _attributes(b"\x0a", resource.attributes))
        for scope, encoded_items in scopes:
            scope_body = _field(b"\x0a", _scope(scope)) + b"".join([_field(b"\x12", item) for item in encoded_items])
            if scope is not None and scope.schema_url:
                scope_body += _field(b"\x1a", _text(scope.schema_url))
            body += _field(b"\x12", scope_body)
        if resource.schema_url:
            body += _field(b"\x1a", _text(resource.schema_url))
        out.append(_field(b"\x0a", body))
    return b"".join(out)


def _triple(span: ReadableSpan) -> tuple[Any, Any, bytes]:
    exact = type(span) in FIELD_READABLE
    resource = span._resource if exact else span.resource
    scope = span._instrumentation_scope if exact else span.instrumentation_scope
    return resource, scope or None, _span(span)


def encode_spans_protobuf(spans: Sequence[ReadableSpan]) -> bytes:
    """A serialized `ExportTraceServiceRequest` for `spans`. Raises `_Unsupported` for a value not
    written here (see the module docstring)."""
    return request(_triple(span) for span in spans)


class _Encoded:
    """What the SDK's exporter does with the encoder's result: serialize it."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def SerializePartialToString(self) -> bytes:
        return self._data

    SerializeToString = SerializePartialToString


def _probe() -> list[ReadableSpan]:
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("k", "v"), ("a", "b")]))  # fmt: skip
    local = SpanContext(2**127 + 5, 2**63 + 7, is_remote=False, trace_flags=TraceFlags(1))
    attributes = {"s": "é\n\"q\" ☃", "empty": "", "i": 3, "zero": 0, "neg": -7, "big": 2**62, "f": 1.5, "f0": 0.0,
                  "t": True, "no": False, "b": b"\x00\x01", "l": ["x", "y"], "li": [1, -2], "lb": [True, False],
                  "lf": [0.5], "le": []}  # fmt: skip
    first = Resource({"service.name": "probe", "n": 2}, "https://schema/1")
    second = Resource({})
    scope = InstrumentationScope("x", "1.0", "https://schema/s")
    other = InstrumentationScope("y")

    def span(name: str, context: SpanContext, parent: SpanContext | None, **kwargs: Any) -> ReadableSpan:
        return ReadableSpan(name=name, context=context, parent=parent, start_time=1_700_000_000_000_000_001,
                            end_time=1_700_000_000_000_500_002, **kwargs)  # fmt: skip

    return [
        span(
            "child ☃",
            local,
            remote,
            resource=first,
            instrumentation_scope=scope,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            events=(Event("event", {"k": 1}, 1_700_000_000_000_000_003), Event("bare", {}, 5)),
            links=(Link(remote, {"w": 1}), Link(local)),
            status=Status(StatusCode.ERROR, "boom"),
        ),
        span(
            "root",
            local,
            None,
            resource=first,
            instrumentation_scope=other,
            kind=SpanKind.SERVER,
            status=Status(StatusCode.OK),
        ),
        span("", remote, local, resource=second, kind=SpanKind.CONSUMER),
        span("producer", local, local, resource=first, instrumentation_scope=scope, kind=SpanKind.PRODUCER),
    ]


@cache
def matches_sdk() -> bool:
    """True if this module writes, byte for byte, what the installed SDK's encoder writes."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    probe = _probe()
    try:
        return encode_spans_protobuf(probe) == encode_spans(probe).SerializePartialToString()
    except Exception:
        return False


def fallback_encoder(
    fast: Callable[[Sequence[Any]], bytes], sdk_encode: Callable[[Sequence[Any]], Any]
) -> Callable[[Sequence[Any]], Any]:
    """An SDK encoder's stand-in: `fast`'s bytes, or `sdk_encode`'s result for a batch `fast` does not
    write (or fails on: the batch is still exported, as the SDK would export it)."""

    def encode(batch: Sequence[Any]) -> Any:
        try:
            return _Encoded(fast(batch))
        except Exception:
            return sdk_encode(batch)

    return encode


def fast_encoder(sdk_encode: Callable[[Sequence[ReadableSpan]], Any]) -> Callable[[Sequence[ReadableSpan]], Any]:
    """`encode_spans` for the SDK's exporter (see `fallback_encoder`)."""
    return fallback_encoder(lambda spans: encode_spans_protobuf(spans), sdk_encode)


def with_encoder(exporter_class: type, global_name: str, make: Callable[[Any], Any]) -> type:
    """A subclass of an SDK OTLP/HTTP exporter whose methods that call the SDK encoder `global_name`
    (`export`, or `_serialize_spans` in SDK 1.27) call `make(<the SDK's encoder>)` instead: the same
    code, run with that one global replaced. The class itself if no method calls it."""
    replaced: dict[str, Any] = {}
    for name in ("export", "_serialize_spans"):
        method = getattr(exporter_class, name, None)
        if isinstance(method, types.FunctionType) and global_name in method.__code__.co_names:
            namespace = dict(method.__globals__)
            namespace[global_name] = make(method.__globals__[global_name])
            function = types.FunctionType(method.__code__, namespace, name, method.__defaults__, method.__closure__)
            function.__kwdefaults__ = method.__kwdefaults__
            function.__qualname__ = method.__qualname__
            replaced[name] = function
    if not replaced:
        return exporter_class
    return type(exporter_class.__name__, (exporter_class,), {**replaced, "__module__": __name__})


@cache
def with_fast_encoding(exporter_class: type) -> type:
    """The SDK's OTLP/HTTP span exporter, encoding with this module (see `with_encoder`), or the
    class itself if `matches_sdk()` is False."""
    if not matches_sdk():
        return exporter_class
    return with_encoder(exporter_class, "encode_spans", fast_encoder)
