"""The last check before spans and log records leave the process: every string stallwatch recorded from the host
passes the scrubber's detector once more, whichever wrapper recorded it and whether or not it scrubbed it.

Where (docs/scrubbing.md): with stallwatch's providers, in `GuardedExporter.export`, which every span and log
exporter of stallwatch's pipeline sits behind, on the batch worker's thread. With the host's
(`STALLWATCH_PROVIDERS=host`), in front of the host's processors instead (`check_host_providers`): every tracer
or logger an SDK provider makes for a `stallwatch` scope hands its items to a `CheckedSpans` / `CheckedLogs`
wrapper around the provider's processors, before any of them sees the item. The host's processors, exporters,
tracers, spans and records are not touched.

What: span names, attribute values (event and link attributes included), status descriptions and log bodies
of stallwatch's own scope and loggers; never the ids `telemetry.IDENTIFIERS` names, nor numbers. A finished
item is shared by every exporter and other threads, so it is never changed: one with something to redact is
exported as a copy that keeps the rest, dropped counts included (`sdk_compat.replaced_span`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import wrapt
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Link, Status

from .. import sdk_compat, telemetry
from ..core.faults import FAULTS
from ..core.scrub import scrub_attributes, scrub_value
from .span_json import plain_attributes

if TYPE_CHECKING:
    from opentelemetry.util.types import AnyValue

_OWN_SCOPE = telemetry.INSTRUMENTATION_SCOPE
_SETTINGS = {"traces": "OTEL_TRACES_EXPORTER", "logs": "OTEL_LOGS_EXPORTER"}


def checked(signal: str, batch: Sequence[Any]) -> Sequence[Any]:
    """`batch` of `signal` ("traces" or "logs") as it may leave: the same sequence when nothing had to change.
    An item that cannot be checked is dropped (counted as a fault of the signal), never exported unchecked."""
    check = _span if signal == "traces" else _log_item
    out: list[Any] | None = None
    for index, item in enumerate(batch):
        result = _one(signal, check, item)
        if result is not item:
            if out is None:
                out = list(batch[:index])
            if result is not None:
                out.append(result)
        elif out is not None:
            out.append(item)
    return batch if out is None else out


def _one(signal: str, check: Callable[[Any], Any], item: Any) -> Any:
    """`check(item)`, or None (counted as a fault of `signal`) when the check itself fails."""
    try:
        return check(item)
    except Exception:
        FAULTS.record(signal, _SETTINGS.get(signal, "OTEL_TRACES_EXPORTER"),
                      "an item that could not be checked for secrets was dropped", off="none")  # fmt: skip
        return None


def _span(span: Any) -> Any:
    """`span`, or a copy with its host-recorded strings scrubbed, if it is one of stallwatch's."""
    fields = sdk_compat.exit_check_fields(span, _OWN_SCOPE)
    if fields is None:
        return span
    name, attributes, events, links, status = fields
    new_name = scrub_value(name) if type(name) is str else name
    new_attributes = _attributes(attributes) if attributes else attributes
    new_events = _events(events) if events else events
    new_links = _links(links) if links else links
    description = status.description if status is not None else None
    new_status = status
    if description:
        scrubbed = scrub_value(description)
        if scrubbed is not description:
            new_status = Status(status.status_code, scrubbed)
    unchanged = new_attributes is attributes and new_events is events and new_links is links
    if unchanged and new_name is name and new_status is status:
        return span
    return sdk_compat.replaced_span(span, new_name, new_attributes, new_events, new_links, new_status)


def _attributes(attributes: Any) -> Any:
    """`attributes` (a dict, or the SDK's `BoundedAttributes`) scrubbed; the same object when nothing changed."""
    if not attributes:
        return attributes
    plain = plain_attributes(attributes)
    if not isinstance(plain, Mapping):
        return attributes
    scrubbed = scrub_attributes(plain)
    if scrubbed is plain:
        return attributes
    if isinstance(attributes, BoundedAttributes):
        immutable = sdk_compat.immutable(attributes)
        # scrubbing keeps each value's kind (a string stays a string, a sequence of strings a sequence)
        values = cast("Mapping[str, AnyValue]", scrubbed)
        bounded = BoundedAttributes(
            attributes.maxlen, values, immutable=immutable, max_value_len=attributes.max_value_len
        )
        bounded.dropped = attributes.dropped  # what the original dropped is still what was dropped
        return bounded
    return dict(scrubbed)


def _events(events: Any) -> Any:
    return _scrubbed_items(events, lambda event, scrubbed: Event(event.name, scrubbed, event.timestamp))


def _links(links: Any) -> Any:
    return _scrubbed_items(links, lambda link, scrubbed: Link(link.context, scrubbed))


def _scrubbed_items(items: Any, rebuilt: Callable[[Any, Any], Any]) -> Any:
    """`items` (events or links) with their attributes scrubbed: each one whose attributes changed
    `rebuilt(item, scrubbed)`, the rest kept; the same `items` object when nothing changed."""
    new = []
    for item in items:
        scrubbed = _attributes(item.attributes)
        new.append(item if scrubbed is item.attributes else rebuilt(item, scrubbed))
    return items if all(a is b for a, b in zip(new, items, strict=True)) else tuple(new)


def _log_item(item: Any) -> Any:
    """A batch item (`LogData` up to SDK 1.38, `ReadableLogRecord` since), or a copy with the record's body and
    attributes scrubbed, if the record comes from a `stallwatch` logger."""
    scope = getattr(item, "instrumentation_scope", None)
    if not _own_scope(getattr(scope, "name", None)):
        return item
    record = item.log_record
    body, attributes = record.body, record.attributes
    new_body = scrub_value(body) if type(body) is str else body
    new_attributes = _attributes(attributes)
    if new_body is body and new_attributes is attributes:
        return item
    new_record = copy.copy(record)
    new_record.body, new_record.attributes = new_body, new_attributes
    clone = copy.copy(item)
    object.__setattr__(clone, "log_record", new_record)  # a frozen dataclass since SDK 1.39
    return clone


class CheckedSpans:
    """The span processor of a tracer for stallwatch's scope made by a host's provider: the provider's own
    processors (`inner`), with each finished span checked first. Whatever else a tracer or span asks of its
    processor (`_on_ending`, the processor list the fast span path reads) is the inner one's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def on_end(self, span: Any) -> None:
        checked = _one("traces", _span, span)
        if checked is not None:
            self.inner.on_end(checked)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class CheckedLogs:
    """The log record processor of a logger for a `stallwatch` scope made by a host's provider, as `CheckedSpans`
    (`on_emit` since SDK 1.39, `emit` before)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def on_emit(self, record: Any) -> None:
        checked = _one("logs", _log_item, record)
        if checked is not None:
            self.inner.on_emit(checked)

    def emit(self, record: Any) -> None:
        checked = _one("logs", _log_item, record)
        if checked is not None:
            self.inner.emit(checked)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _own_scope(name: object) -> bool:
    """Whether `name` is stallwatch's scope or one of its loggers' (`stallwatch.*`)."""
    return type(name) is str and (name == _OWN_SCOPE or name.startswith(_OWN_SCOPE + "."))


def check_log_handlers() -> None:
    """Every SDK `LoggingHandler` emits a record of a `stallwatch` logger under that logger's scope, which
    the exit check knows it by, on SDKs whose handler would not (`sdk_compat.emit_through_record_loggers`)."""
    sdk_compat.emit_through_record_loggers(_own_scope)


def _scope_name(name: object = None, *args: object, **kwargs: object) -> object:
    """The first argument of `get_tracer` / `get_logger`, however it was passed."""
    return kwargs.get("instrumenting_module_name", kwargs.get("name", name))


def _checked_tracer(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    tracer = wrapped(*args, **kwargs)
    try:
        if _scope_name(*args, **kwargs) == _OWN_SCOPE:
            processor = getattr(tracer, "span_processor", None)  # none on a disabled provider's no-op tracer
            if processor is not None and type(processor) is not CheckedSpans:
                tracer.span_processor = CheckedSpans(processor)
    except Exception:
        _unchecked("traces")
    return tracer


def _checked_logger(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    logger = wrapped(*args, **kwargs)
    try:
        if _own_scope(_scope_name(*args, **kwargs)):
            sdk_compat.checked_logger(logger, CheckedLogs, CheckedLogs)
    except Exception:
        _unchecked("logs")
    return logger


def _unchecked(signal: str) -> None:
    FAULTS.record(signal, "STALLWATCH_PROVIDERS", "stallwatch's items may reach the host's exporters unchecked",
                  off="stallwatch")  # fmt: skip


@functools.cache
def check_host_providers() -> None:
    """Route stallwatch's spans and log records through the exit check in every SDK tracer and logger provider
    (the host's, with `STALLWATCH_PROVIDERS=host`), whenever it was or will be built: a tracer or logger for a
    `stallwatch` scope gets its provider's processors behind `CheckedSpans` / `CheckedLogs`. Once per process;
    other scopes' tracers and loggers come back as the provider made them."""
    from opentelemetry.sdk import _logs as sdk_logs
    from opentelemetry.sdk import trace as sdk_trace

    wrapt.wrap_function_wrapper(sdk_trace, "TracerProvider.get_tracer", _checked_tracer)
    wrapt.wrap_function_wrapper(sdk_logs, "LoggerProvider.get_logger", _checked_logger)
    check_log_handlers()
