"""OTLP/JSON for log records, written straight from the SDK's batch items.

The protobuf route (the SDK's OTLP encoder, `MessageToDict`, `json.dumps`) costs the batch worker CPU
that, under a GIL, is taken from the host's threads, as for spans (see `span_json`). This encoder
writes the same JSON document, byte for byte, from the records' own fields: resources and scopes
grouped as the SDK's encoder groups them (by equality, in order of first appearance), the fields
protobuf's printer omits when empty or zero omitted, ids in hex, 64-bit integers and timestamps as
strings, bodies and attributes as `AnyValue`s; a test checks it against the protobuf route.

It reads both batch item shapes of opentelemetry-sdk 1.27 to 1.45 (`LogData` up to 1.38,
`ReadableLogRecord` from 1.39). Whatever those versions' encoders write differently, or protobuf
refuses, sends the whole batch down the protobuf route: None values (which SDKs 1.33 to 1.39 also
make of attribute lists of mixed types), strings that are not UTF-8, integers out of range, unknown
value or item types, and, before 1.39, scope attributes, scope schema URLs and event names.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from typing import Any

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from ..sdk_compat import encode_logs
from .span_json import plain_attributes

try:  # opentelemetry-sdk 1.39 and later
    from opentelemetry.sdk._logs import ReadableLogRecord as _BatchItem

    _RESOURCE_ON_ITEM = True
except ImportError:  # up to 1.38: the resource and the dropped count are on the SDK's LogRecord
    from opentelemetry.sdk._logs import LogData as _BatchItem  # type: ignore[attr-defined, no-redef]  # gone in 1.39

    _RESOURCE_ON_ITEM = False

_INT64 = 2**63
_UINT32 = 2**32
_UINT64 = 2**64
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


class _Unsupported(Exception):
    """Something this encoder does not write the way the installed SDK's encoder + protobuf do."""


def _text(value: Any) -> str:
    """A protobuf string: a `str` that encodes to UTF-8 (protobuf refuses lone surrogates)."""
    if not isinstance(value, str):
        raise _Unsupported
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise _Unsupported from None
    return value


def _uint(value: Any, limit: int) -> int:
    """A protobuf unsigned integer: None is unset (0); bools, non-integers and overflows are refused."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise _Unsupported
    return int(value)


def _value(value: Any) -> dict[str, Any]:
    """An OTLP `AnyValue`, as the SDK's `_encode_value` builds it and protobuf prints it."""
    if isinstance(value, str):
        return {"stringValue": _text(value)}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise _Unsupported
        return {"intValue": str(int(value))}
    if isinstance(value, float):
        return {"doubleValue": value if math.isfinite(value) else _NON_FINITE[repr(float(value))]}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [_value(v) for v in value]} if value else {}}
    if isinstance(value, dict):
        return {"kvlistValue": {"values": [_key_value(str(k), v) for k, v in value.items()]} if value else {}}
    raise _Unsupported  # None (written differently by each SDK version) and types protobuf refuses


def _key_value(key: Any, value: Any) -> dict[str, Any]:
    encoded = _value(value)
    return {"key": key, "value": encoded} if _text(key) else {"value": encoded}


# Most attributes of the `logging` bridge repeat from record to record (the logger's own keys, code
# paths, function names) and so do many bodies: the encoded form of a short string value is kept and
# shared (`json` writes a shared dict as many times as it appears). Each cache is emptied when it
# reaches its limit, so values that never repeat cost one insert each and the memory stays bounded.
_CACHE_LIMIT = 1024
_CACHED_VALUE_CHARS = 128
_pairs: dict[tuple[str, str], dict[str, Any]] = {}
_bodies: dict[str, dict[str, Any]] = {}


def _kept(cache: dict[Any, dict[str, Any]], key: Any, encoded: dict[str, Any], value: str) -> dict[str, Any]:
    """`encoded`, kept in `cache` under `key` if `value` is short."""
    if len(value) <= _CACHED_VALUE_CHARS:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = encoded
    return encoded


def _attributes(attributes: Any) -> list[dict[str, Any]]:
    out = []
    for key, value in plain_attributes(attributes).items():
        if type(value) is str and type(key) is str:
            out.append(_pairs.get((key, value)) or _kept(_pairs, (key, value), _key_value(key, value), value))
        else:
            out.append(_key_value(key, value))
    return out


def _body(body: Any) -> dict[str, Any]:
    if type(body) is not str:
        return _value(body)
    return _bodies.get(body) or _kept(_bodies, body, _value(body), body)


def _unpack(item: Any) -> tuple[LogRecord, Any, Any, Any]:
    """(record, resource, scope, dropped attribute count) of a batch item, read as the SDK's encoder reads them."""
    if not isinstance(item, _BatchItem) or not isinstance(item.log_record, LogRecord):
        raise _Unsupported
    record = item.log_record
    if _RESOURCE_ON_ITEM:
        return record, item.resource, item.instrumentation_scope, item.dropped_attributes
    if getattr(record, "event_name", None):
        raise _Unsupported
    return record, record.resource, item.instrumentation_scope, record.dropped_attributes  # type: ignore[attr-defined]  # up to 1.38


def _record(record: LogRecord, dropped: Any) -> dict[str, Any]:
    """One OTLP `LogRecord`, fields in protobuf's (field number) order."""
    out: dict[str, Any] = {}
    timestamp = _uint(record.timestamp, _UINT64)
    if timestamp:
        out["timeUnixNano"] = str(timestamp)
    severity = record.severity_number
    if not isinstance(severity, SeverityNumber):
        raise _Unsupported
    if severity.value:
        out["severityNumber"] = severity.value
    if record.severity_text:
        out["severityText"] = _text(record.severity_text)
    out["body"] = _body(record.body)
    if record.attributes:
        out["attributes"] = _attributes(record.attributes)
    dropped = _uint(dropped, _UINT32)
    if dropped:
        out["droppedAttributesCount"] = dropped
    # The ids and flags read as the SDK's encoder reads them: what it trips on (None) raises here too.
    flags = _uint(int(record.trace_flags), _UINT32)
    if flags:
        out["flags"] = flags
    if record.trace_id != 0:
        out["traceId"] = record.trace_id.to_bytes(length=16, byteorder="big", signed=False).hex()
    if record.span_id != 0:
        out["spanId"] = record.span_id.to_bytes(length=8, byteorder="big", signed=False).hex()
    observed = _uint(record.observed_timestamp, _UINT64)
    if observed:
        out["observedTimeUnixNano"] = str(observed)
    if _RESOURCE_ON_ITEM and record.event_name:
        out["eventName"] = _text(record.event_name)
    return out


def _scope_logs(scope: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
    encoded: dict[str, Any] = {}
    schema_url: str | None = ""
    if scope is not None:
        if not isinstance(scope, InstrumentationScope):
            raise _Unsupported
        if scope.name:
            encoded["name"] = _text(scope.name)
        if scope.version:
            encoded["version"] = _text(scope.version)
        attributes = getattr(scope, "attributes", None)
        if not _RESOURCE_ON_ITEM and (attributes or scope.schema_url):
            raise _Unsupported  # SDK 1.27 writes neither, 1.33 both
        if attributes:
            encoded["attributes"] = _attributes(attributes)
        schema_url = scope.schema_url
    out: dict[str, Any] = {"scope": encoded, "logRecords": records}
    if schema_url:
        out["schemaUrl"] = _text(schema_url)
    return out


def _resource_logs(resource: Resource, scope_logs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"resource": {"attributes": _attributes(resource.attributes)} if resource.attributes else {}}
    out["scopeLogs"] = scope_logs
    if resource.schema_url:
        out["schemaUrl"] = _text(resource.schema_url)
    return out


def _encode(batch: Sequence[Any]) -> str:
    # Grouped by equality, as the SDK's encoder groups them (equal resources from two providers
    # share an entry), but each resource object is hashed once: `Resource.__hash__` dumps the
    # attributes to JSON.
    by_id: dict[int, dict[Any, list[dict[str, Any]]]] = {}
    by_resource: dict[Resource, dict[Any, list[dict[str, Any]]]] = {}
    for item in batch:
        record, resource, scope, dropped = _unpack(item)
        scopes = by_id.get(id(resource))
        if scopes is None:
            if not isinstance(resource, Resource):
                raise _Unsupported
            scopes = by_id[id(resource)] = by_resource.setdefault(resource, {})
        scopes.setdefault(scope or None, []).append(_record(record, dropped))
    resource_logs = [
        _resource_logs(resource, [_scope_logs(scope, records) for scope, records in scopes.items()])
        for resource, scopes in by_resource.items()
    ]
    return json.dumps({"resourceLogs": resource_logs} if resource_logs else {}, separators=(",", ":"))


def _protobuf_route(batch: Sequence[Any]) -> str:
    from .otlp_json import to_otlp_json  # footprint: protobuf's JSON printer, for the records written this way

    return to_otlp_json(encode_logs(batch))


def encode_logs_json(batch: Sequence[Any]) -> str:
    """One OTLP/JSON `ExportLogsServiceRequest` line for `batch`, the one the protobuf route writes."""
    try:
        return _encode(batch)
    except _Unsupported:
        return _protobuf_route(batch)
