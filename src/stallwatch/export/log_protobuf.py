"""OTLP protobuf for log records, written straight from the SDK's batch items, for the OTLP/HTTP
log exporter.

The SDK's encoder builds protobuf objects from Python, on the batch processor's export thread but
under the host's GIL. This module writes the same bytes the way `span_protobuf` does for spans, and
is used under the same rule: `matches_sdk()` encodes a probe batch, made by the SDK's own `logging`
handler, both ways and the SDK's encoder stays unless the bytes are identical; a batch holding a
value this module does not write (None, mappings, text that is not UTF-8, integers past 64 bits,
other types) goes to the SDK's encoder whole. The two batch item shapes (`LogData` up to SDK 1.38,
`ReadableLogRecord` since 1.39) are read as `log_json` reads them.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from opentelemetry._logs import SeverityNumber

from . import log_json
from .span_protobuf import (
    _any_value,
    _attributes,
    _count,
    _field,
    _fixed32,
    _fixed64,
    _text,
    _Unsupported,
    _varint,
    fallback_encoder,
    request,
    with_encoder,
)


def _record(item: Any) -> tuple[Any, Any, bytes]:
    """(resource, scope, the encoded `LogRecord`) of one batch item."""
    try:
        record, resource, scope, dropped = log_json._unpack(item)
    except log_json._Unsupported:
        raise _Unsupported from None
    parts = []
    if record.timestamp:
        parts.append(b"\x09" + _fixed64(record.timestamp))
    severity = record.severity_number
    if not isinstance(severity, SeverityNumber):
        raise _Unsupported
    if severity.value:
        parts.append(b"\x10" + _varint(severity.value))
    if record.severity_text:
        parts.append(_field(b"\x1a", _text(record.severity_text)))
    body = record.body
    parts.append(_field(b"\x2a", b"" if body is None else _any_value(body)))
    parts.append(_attributes(b"\x32", record.attributes))
    parts.append(_count(b"\x38", dropped or 0))
    flags = int(record.trace_flags)
    if flags:
        parts.append(b"\x45" + _fixed32(flags))
    if record.trace_id:
        parts.append(b"\x4a\x10" + record.trace_id.to_bytes(16, "big"))
    if record.span_id:
        parts.append(b"\x52\x08" + record.span_id.to_bytes(8, "big"))
    if record.observed_timestamp:
        parts.append(b"\x59" + _fixed64(record.observed_timestamp))
    event_name = getattr(record, "event_name", None)
    if event_name:
        parts.append(_field(b"\x62", _text(event_name)))
    return resource, scope or None, b"".join(parts)


def encode_logs_protobuf(batch: Sequence[Any]) -> bytes:
    """A serialized `ExportLogsServiceRequest` for `batch`. Raises `_Unsupported` for a value not
    written here (see the module docstring)."""
    return request(_record(item) for item in batch)


def _probe() -> list[Any]:
    """Batch items made by the SDK's own `logging` handler: every body and attribute kind this
    module writes, severities, a record inside a sampled span, an exception, two resources."""
    from opentelemetry import trace
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs import export as log_export
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    # Renamed in SDK 1.39 (the old name warns); the SDK's handler is deprecated there but still the one
    # stallwatch installs. Neither warning is the host's business.
    exporter = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter
    exporter = exporter()
    loggers = []
    for number, resource in enumerate((Resource({"service.name": "probe", "n": 2}, "https://schema/1"), Resource({}))):
        provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_log_record_processor(log_export.SimpleLogRecordProcessor(exporter))
        logger = logging.Logger(f"stallwatch.probe.{number}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            logger.addHandler(LoggingHandler(logger_provider=provider))
        logger.propagate = False
        loggers.append(logger)
    first, second = loggers
    attributes = {"s": 'é\n"q" ☃', "empty": "", "i": 3, "zero": 0, "neg": -7, "f": 1.5, "f0": 0.0, "t": True,
                  "no": False, "b": b"\x00\x01", "l": ["x", "y"], "li": [1, -2], "le": []}  # fmt: skip
    first.info("plain %s", "message", extra=attributes)
    for level in (5, logging.DEBUG, logging.WARNING, logging.ERROR, logging.CRITICAL):
        first.log(level, "level %d", level)
    for body in (42, 2.5, True, b"\x01", ["x", 1], ""):
        second.warning(body)
    context = SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(1))
    with trace.use_span(NonRecordingSpan(context)):
        try:
            raise ValueError("bad ☃")
        except ValueError:
            first.exception("failed %d", 3)
    return list(exporter.get_finished_logs())


@cache
def matches_sdk() -> bool:
    """True if this module writes, byte for byte, what the installed SDK's encoder writes."""
    from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs

    try:
        probe = _probe()
        return encode_logs_protobuf(probe) == encode_logs(probe).SerializeToString()
    except Exception:
        return False


def fast_encoder(sdk_encode: Callable[[Sequence[Any]], Any]) -> Callable[[Sequence[Any]], Any]:
    """`encode_logs` for the SDK's exporter (see `span_protobuf.fallback_encoder`)."""
    return fallback_encoder(lambda batch: encode_logs_protobuf(batch), sdk_encode)


@cache
def with_fast_encoding(exporter_class: type) -> type:
    """The SDK's OTLP/HTTP log exporter, encoding with this module (see `span_protobuf.with_encoder`),
    or the class itself if `matches_sdk()` is False."""
    if not matches_sdk():
        return exporter_class
    return with_encoder(exporter_class, "encode_logs", fast_encoder)
