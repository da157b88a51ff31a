"""The direct log encoder writes what the SDK's OTLP encoder + protobuf's JSON printer write."""

from __future__ import annotations

import json
import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs import export as log_export
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from stallwatch.export import log_json
from stallwatch.export.file import to_otlp_json
from stallwatch.export.log_json import encode_logs_json

pytestmark = pytest.mark.matrix  # the protobuf route and the batch items differ across SDK versions

# Renamed in SDK 1.39; the old name warns there.
_InMemoryExporter: Any = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter
_SCHEMA = "https://opentelemetry.io/schemas/1.21.0"
_ATTRIBUTES = {"s": "é\n\"q\" \U0001f600", "empty": "", "i": 3, "zero": 0, "neg": -7, "big": 2**62, "f": 1.5,
               "fzero": 0.0, "nan": float("nan"), "inf": float("inf"), "t": True, "false": False, "b": b"\x00\xff",
               "l": ["x", "y"], "li": [1, 2], "lb": [True, False], "lf": [0.5, -1.0], "tuple": (3, 4), "lempty": [],
               "nested": {"k": "v", "n": {"x": [1, 2]}, "e": {}}}  # fmt: skip


class _Bridge:
    """Log records through the SDK's `logging` handler, as stallwatch emits them, into one exporter."""

    def __init__(self) -> None:
        self.exporter = _InMemoryExporter()
        self._handlers: dict[str, LoggingHandler] = {}

    def provider(self, name: str, resource: Resource) -> LoggerProvider:
        provider = LoggerProvider(resource=resource)
        provider.add_log_record_processor(log_export.SimpleLogRecordProcessor(self.exporter))
        with warnings.catch_warnings():  # deprecated in the SDK since 1.39, still what stallwatch uses
            warnings.simplefilter("ignore", DeprecationWarning)
            self._handlers[name] = LoggingHandler(logger_provider=provider)
        return provider

    def logger(self, provider: str, scope: str) -> logging.Logger:
        logger = logging.Logger(scope, level=1)  # outside the logging module's registry and hierarchy
        logger.addHandler(self._handlers[provider])
        return logger

    def emit(self, provider: str, logger: Any, message: str, event_name: str | None = None) -> None:
        """`message`, translated by the provider's handler, through `logger`: one of the provider's
        SDK loggers, whose scope can have a version, attributes, a schema URL.
        """
        record = logging.LogRecord("x", logging.INFO, __file__, 1, message, (), None, func="emit")
        translated = self._handlers[provider]._translate(record)
        if event_name is not None:
            translated.event_name = event_name
        logger.emit(translated)

    def batch(self) -> list[Any]:
        return list(self.exporter.get_finished_logs())


def _in_span(trace_flags: int) -> Any:
    context = SpanContext(0x0123456789ABCDEF0123456789ABCDEF, 0x0123456789ABCDEF, False, TraceFlags(trace_flags))
    return trace.use_span(NonRecordingSpan(context))


def _batch() -> list[Any]:
    bridge = _Bridge()
    provider = bridge.provider("a", Resource.create({"service.name": "svc", "n": 2}))
    bridge.provider("b", Resource({"r": "x"}, _SCHEMA))
    bridge.provider("c", Resource({"r": "x"}, _SCHEMA))  # equal to b's: one resource entry
    bridge.provider("bare", Resource({}))
    app, db = bridge.logger("a", "app"), bridge.logger("a", "lib.db")
    app.info("plain %s", "message", extra=_ATTRIBUTES)
    for level in (5, logging.DEBUG, logging.INFO, 25, logging.WARNING, logging.ERROR, logging.CRITICAL, 60):
        app.log(level, "level %d", level)
    for body in (42, -1, 2.5, True, b"\x01\x02", ["x", 1, 2.5], ("t", False), {"k": [1, {"n": "v"}], "e": []}, ""):
        db.warning(body)
    app.info('é ☃ \U0001f600 "quoted"\n\ttab \x00')
    with _in_span(1):
        app.info("in a sampled span")
        try:
            raise ValueError("bad ☃")
        except ValueError:
            db.exception("failed %d", 3)
    with _in_span(0):
        app.error("in an unsampled span", extra={"k": 1})
    bridge.emit("a", provider.get_logger("explicit", "1.0"), "a scope with a version")
    bridge.logger("b", "app").info("other resource")
    app.info("first resource again")
    bridge.logger("c", "app").info("equal resource, equal scope")
    bridge.logger("c", "other").info("equal resource, other scope")
    bridge.logger("bare", "app").info("resource without attributes")
    batch = bridge.batch()
    batch[1].log_record.attributes = BoundedAttributes(maxlen=2, attributes={"a": 1, "b": 2, "c": 3})  # 1 dropped
    return batch


def _reference(batch: Sequence[Any]) -> Any:
    return json.loads(to_otlp_json(encode_logs(batch)))


def _spy_fallback(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of each batch sent down the protobuf route."""
    calls: list[int] = []
    route: Callable[[Sequence[Any]], str] = log_json._protobuf_route

    def spy(batch: Sequence[Any]) -> str:
        calls.append(len(batch))
        return route(batch)

    monkeypatch.setattr(log_json, "_protobuf_route", spy)
    return calls


def _count(document: dict[str, Any]) -> int:
    return sum(len(s["logRecords"]) for r in document["resourceLogs"] for s in r["scopeLogs"])


def test_the_direct_encoder_matches_the_protobuf_route(monkeypatch):
    fallbacks = _spy_fallback(monkeypatch)
    batch = _batch()
    line = encode_logs_json(batch)
    ours = json.loads(line)
    assert ours == _reference(batch)
    assert line == to_otlp_json(encode_logs(batch))  # byte for byte, too
    assert fallbacks == []
    assert _count(ours) == len(batch) == 28
    # SDK 1.27's handler logs every record under one scope, its own module's name.
    assert len(ours["resourceLogs"]) == 3 and len(ours["resourceLogs"][0]["scopeLogs"]) >= 2
    assert encode_logs_json([]) == to_otlp_json(encode_logs([])) == "{}"


def test_scope_attributes_schema_urls_and_event_names_match(monkeypatch):
    """Written directly from SDK 1.39 on; older SDKs' encoders differ, and those batches take the protobuf route."""
    fallbacks = _spy_fallback(monkeypatch)
    bridge = _Bridge()
    provider = bridge.provider("a", Resource.create({"service.name": "svc"}))
    scoped = provider.get_logger("lib", "2.0", _SCHEMA, {"scope.a": 1, "scope.l": ["x"]})
    bridge.emit("a", scoped, "scoped", event_name="lib.event")
    bridge.logger("a", "app").info("unscoped")
    batch = bridge.batch()
    assert json.loads(encode_logs_json(batch)) == _reference(batch)
    assert fallbacks == ([] if log_json._RESOURCE_ON_ITEM else [2])


def _odd_batch(case: str) -> list[Any]:
    """Two records, the second one with something this encoder leaves to the protobuf route."""
    bridge = _Bridge()
    bridge.provider("a", Resource.create({"service.name": "svc"}))
    bridge.logger("a", "app").info("fine", extra={"k": 1})
    bridge.logger("a", "app").info("odd")
    batch = bridge.batch()
    odd = batch[-1]
    if case == "surrogate":  # protobuf refuses it: the SDK's encoder drops the attribute
        odd.log_record.attributes = BoundedAttributes(attributes={"path": "/tmp/\udcff", "k": 2})
    elif case == "int64 overflow":  # likewise
        odd.log_record.attributes = BoundedAttributes(attributes={"n": 2**64, "k": 2})
    else:  # what the SDK's encoder reads, on an object of no SDK class
        batch[-1] = types.SimpleNamespace(
            log_record=odd.log_record,
            resource=getattr(odd, "resource", None),
            instrumentation_scope=odd.instrumentation_scope,
            dropped_attributes=0,
        )
    return batch


@pytest.mark.parametrize("case", ["surrogate", "int64 overflow", "unknown item"])
def test_what_the_encoder_does_not_know_takes_the_protobuf_route(monkeypatch, case):
    batch = _odd_batch(case)
    fallbacks = _spy_fallback(monkeypatch)
    ours = json.loads(encode_logs_json(batch))
    assert fallbacks == [2]
    assert ours == _reference(batch)
    assert _count(ours) == 2


def _outcome(encode: Callable[[Sequence[Any]], str], batch: Sequence[Any]) -> Any:
    try:
        return json.loads(encode(batch))
    except Exception as error:
        return type(error)


@pytest.mark.parametrize("body", [None, [1, None], {"k": None}, {1, 2}])
def test_none_and_unknown_values_end_as_the_protobuf_route_ends(body):
    """The SDK's encoders write None differently in each version (1.27 refuses it), and refuse sets.

    SDKs 1.33 to 1.39 also turn a list of mixed types in an attribute into None.
    """
    bridge = _Bridge()
    bridge.provider("a", Resource.create({"service.name": "svc"}))
    bridge.logger("a", "app").info("fine")
    bridge.logger("a", "app").info("odd", extra={"none": None, "mixed": [1, "a"]})
    batch = bridge.batch()
    batch[-1].log_record.body = body
    assert _outcome(encode_logs_json, batch) == _outcome(lambda b: to_otlp_json(encode_logs(b)), batch)


def test_cached_attribute_and_body_texts_stay_bounded_and_match_the_protobuf_route(monkeypatch):
    fallbacks = _spy_fallback(monkeypatch)
    monkeypatch.setattr(log_json, "_CACHE_LIMIT", 4)
    monkeypatch.setattr(log_json, "_pairs", {})
    monkeypatch.setattr(log_json, "_bodies", {})
    batch = _batch()
    for _ in range(2):  # the second time from what the first left in the caches
        assert encode_logs_json(batch) == to_otlp_json(encode_logs(batch))
        assert 0 < len(log_json._pairs) <= 4 and 0 < len(log_json._bodies) <= 4
    assert fallbacks == []
    monkeypatch.setattr(log_json, "_CACHE_LIMIT", 1024)
    encode_logs_json(batch)
    long_values = [v for k, v in log_json._pairs if len(v) > log_json._CACHED_VALUE_CHARS]
    assert log_json._pairs and not long_values
