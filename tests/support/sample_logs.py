"""Log records for the encoder tests, made through the SDK's `logging` handler as stallwatch emits them."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs import export as log_export
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

# Renamed in SDK 1.39; the old name warns there.
InMemoryLogs: Any = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter
SCHEMA = "https://opentelemetry.io/schemas/1.21.0"
ATTRIBUTES = {"s": "é\n\"q\" \U0001f600", "empty": "", "i": 3, "zero": 0, "neg": -7, "big": 2**62, "f": 1.5,
               "fzero": 0.0, "nan": float("nan"), "inf": float("inf"), "t": True, "false": False, "b": b"\x00\xff",
               "l": ["x", "y"], "li": [1, 2], "lb": [True, False], "lf": [0.5, -1.0], "tuple": (3, 4), "lempty": [],
               "nested": {"k": "v", "n": {"x": [1, 2]}, "e": {}}}  # fmt: skip


class Bridge:
    """Log records through the SDK's `logging` handler, as stallwatch emits them, into one exporter."""

    def __init__(self) -> None:
        self.exporter = InMemoryLogs()
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


def in_span(trace_flags: int) -> Any:
    context = SpanContext(0x0123456789ABCDEF0123456789ABCDEF, 0x0123456789ABCDEF, False, TraceFlags(trace_flags))
    return trace.use_span(NonRecordingSpan(context))


def log_batch() -> list[Any]:
    """Log records of every shape the encoders meet: levels, bodies, attributes, spans, scopes, resources."""
    bridge = Bridge()
    provider = bridge.provider("a", Resource.create({"service.name": "svc", "n": 2}))
    bridge.provider("b", Resource({"r": "x"}, SCHEMA))
    bridge.provider("c", Resource({"r": "x"}, SCHEMA))  # equal to b's: one resource entry
    bridge.provider("bare", Resource({}))
    app, db = bridge.logger("a", "app"), bridge.logger("a", "lib.db")
    app.info("plain %s", "message", extra=ATTRIBUTES)
    for level in (5, logging.DEBUG, logging.INFO, 25, logging.WARNING, logging.ERROR, logging.CRITICAL, 60):
        app.log(level, "level %d", level)
    for body in (42, -1, 2.5, True, b"\x01\x02", ["x", 1, 2.5], ("t", False), {"k": [1, {"n": "v"}], "e": []}, ""):
        db.warning(body)
    app.info('é ☃ \U0001f600 "quoted"\n\ttab \x00')
    with in_span(1):
        app.info("in a sampled span")
        try:
            raise ValueError("bad ☃")
        except ValueError:
            db.exception("failed %d", 3)
    with in_span(0):
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
