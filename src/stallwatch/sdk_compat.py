"""The one door to the OpenTelemetry SDK's private names and layouts (opentelemetry-api, -sdk and the
OTLP exporters, 1.27 to 1.45); what runs at fork time is in `forksafe.otel_compat`, the other half.
`tests/test_sdk_door.py` fails on a private SDK name used anywhere else. It imports nothing of stallwatch.

Fast paths, each the same result as the public objects, cheaper: `LightSpan` for the SDK's span, span
fields read without the properties, the OTLP exporters' encoders replaced, a gRPC batch encoded once
per export, the context's `ContextVar` set directly, tracers that shed spans nobody would export,
`opentelemetry.context.attach`/`detach` noted for the heartbeat, instrumentors switched without
`BaseInstrumentor` (`mirror_installation`). With `STALLWATCH_FAST_PATHS=false` none is taken.

Held in both modes, having no public equivalent: the exit check on log records (`checked_logger`, and
`emit_through_record_loggers` up to SDK 1.27), whether a `BoundedAttributes` is closed (`immutable`),
replay into the provider's processors (`active_span_processor`), a Prometheus reader's data, what a reader
or exporter was built with, the API's placeholder providers, the distro's configurator base and the OTLP
log encoder (private modules).
"""

from __future__ import annotations

import contextvars
import os
import threading
import traceback
import types as pytypes
from collections.abc import Callable, Mapping, Sequence
from time import time_ns
from typing import Any, cast

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import ReadableSpan, sampling
from opentelemetry.sdk.trace import export as sdk_export
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.version import __version__ as sdk_version
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util import types

_FAST = [os.environ.get("STALLWATCH_FAST_PATHS", "true").strip().lower() not in ("false", "0", "no", "off")]


def fast_paths() -> bool:
    """Whether the fast paths are taken (`STALLWATCH_FAST_PATHS`, as `setup()` read it last)."""
    return _FAST[0]


def use_fast_paths(on: bool) -> None:
    """Take the fast paths from now on, or not (`setup()`, from its settings). Objects already built
    keep what they chose (a histogram its aggregation, an exporter its encoder)."""
    _FAST[0] = on


# ---- BaseInstrumentor (opentelemetry-instrumentation 0.48b0 to 0.66b2) ----


class _InstalledFlag:
    """`BaseInstrumentor._is_instrumented_by_opentelemetry` (read by `instrument()` and `uninstrument()`,
    set after `_instrument` and `_uninstrument`) as an installation's `on`."""

    def __init__(self, installation: Any) -> None:
        self._installation = installation

    def __get__(self, instance: object, owner: type | None = None) -> bool:
        return bool(self._installation.on)

    def __set__(self, instance: object, value: bool) -> None:
        self._installation.on = bool(value)


def mirror_installation(instrumentor_class: type, installation: Any) -> None:
    """With the fast paths on, `instrumentor_class` (a `BaseInstrumentor`) is instrumented exactly while
    `installation.on`: `setup()`, which switches the installation without loading `BaseInstrumentor`,
    leaves its instrumentor saying so, and that instrumentor's `uninstrument()` undoes it. Off, the flag
    stays `BaseInstrumentor`'s own, and `setup()` goes through `instrument()`."""
    if fast_paths():
        instrumentor_class._is_instrumented_by_opentelemetry = _InstalledFlag(installation)  # type: ignore[attr-defined]


# ---- SpanContext: a tuple (API 1.27 to 1.45) ----

_TRACE_FLAGS = tuple(TraceFlags(flags) for flags in range(256))  # immutable: shared, as flag values repeat
_TRACE_ID_MAX, _SPAN_ID_MAX = 2**128 - 1, 2**64 - 1  # as the API bounds ids
_new_tuple = tuple.__new__
NO_PARENT = (0, 0, False, 0, None, False)  # `span_context_fields` of no span context


def new_span_context(trace_id: int, span_id: int, flags: int, trace_state: trace.TraceState | None) -> SpanContext:
    """`SpanContext(trace_id, span_id, False, TraceFlags(flags), trace_state)`, the tuple its `__new__`
    builds (`test_light_span` compares the two), without the call."""
    return _new_tuple(
        SpanContext,
        (
            trace_id,
            span_id,
            False,
            _TRACE_FLAGS[flags],
            trace.DEFAULT_TRACE_STATE if trace_state is None else trace_state,
            0 < trace_id <= _TRACE_ID_MAX and 0 < span_id <= _SPAN_ID_MAX,
        ),
    )


def span_context_fields(context: SpanContext | None) -> tuple[Any, ...]:
    """(trace id, span id, is remote, trace flags, trace state, is valid) of `context` (`NO_PARENT` for
    None), read at once from the tuple it is rather than through six properties."""
    return context or NO_PARENT


# ---- the SDK tracer's parts ----

_PARENT_BASED = (sampling.ParentBased, sampling.ParentBasedTraceIdRatio)  # exact types: a subclass may decide otherwise


def parent_based_delegate(sampler: Any, has_parent: bool, parent_sampled: bool, parent_remote: bool) -> Any:
    """The sampler a stock parent-based `sampler` hands the decision to, or None if that is not known
    without calling it (another sampler, or an unsampled parent)."""
    if type(sampler) not in _PARENT_BASED:
        return None
    if not has_parent:
        return sampler._root
    if parent_sampled:
        return sampler._remote_parent_sampled if parent_remote else sampler._local_parent_sampled
    return None


def samples_sampled_local_children(sampler: Any) -> bool:
    """Whether `sampler` records and samples every span with a sampled local parent, without asking it
    (the SDK's default, `parentbased_always_on`, and `parentbased_traceidratio`)."""
    return type(sampler) in _PARENT_BASED and sampler._local_parent_sampled is sampling.ALWAYS_ON


def span_processors(processor: Any) -> tuple[Any, ...] | None:
    """The span processors inside a provider's multi-processor (`tracer.span_processor`), or None."""
    return getattr(processor, "_span_processors", None)


def active_span_processor(provider: Any) -> Any:
    """The SDK tracer provider's own multi-processor: `on_end` there reaches every processor added."""
    return provider._active_span_processor


def plain_tracer(tracer: Any) -> bool:
    """Whether a span the SDK `tracer` starts is nothing but the sampler's decision and the processors:
    the tracer is enabled (the SDK 1.45+ tracer configurator) and records no self-metrics (1.45+)."""
    is_enabled = getattr(tracer, "_is_enabled", None)
    if is_enabled is not None and not is_enabled():
        return False
    metrics = getattr(tracer, "_tracer_metrics", None)
    return metrics is None or type(metrics).__name__ == "NoOpTracerMetrics"


def retype_tracer(tracer: Any, cls: type) -> None:
    """Make the SDK `tracer` (built by the SDK's `get_tracer`, whose arguments change between
    versions) a `cls`, a subclass that adds no state."""
    tracer.__class__ = cls


# The SDK's span processors read an ended span's `context.trace_flags` unguarded up to 1.33, raising
# AttributeError for a `ReadableSpan` given no context; from 1.34 they drop such a span.
CONTEXTLESS_SPAN_RAISES = tuple(int(part) for part in sdk_version.split(".")[:2]) < (1, 34)
_STOCK = (sdk_trace.SpanProcessor, sdk_export.BatchSpanProcessor, sdk_export.SimpleSpanProcessor)
_NO_OP_ON_START = frozenset(stock.on_start for stock in _STOCK)  # each is `pass`
_NO_OP_ON_ENDING = frozenset(getattr(stock, "_on_ending", None) for stock in _STOCK)  # SDK 1.45+; `pass`
_eligible: tuple[object, bool] = (object(), False)  # (the processors tuple last checked, its verdict)
# (tracer given, SDK tracer fit for the light path, its `_is_enabled` or None)
_resolved: tuple[object, sdk_trace.Tracer | None, Any] = (None, None, None)


def _processors_eligible(processors: Any) -> bool:
    """True when starting a span would call no processor code (`on_start` and `_on_ending` no-ops)."""
    global _eligible
    verdict = processors is not None and all(
        type(p).on_start in _NO_OP_ON_START and getattr(type(p), "_on_ending", None) in _NO_OP_ON_ENDING
        for p in processors
    )
    _eligible = (processors, verdict)
    return verdict


def _resolve(tracer: Any) -> sdk_trace.Tracer | None:
    tracer = getattr(tracer, "_real_tracer", None) or tracer  # a global ProxyTracer resolves to it
    if type(tracer) is not sdk_trace.Tracer:
        return None
    metrics = getattr(tracer, "_tracer_metrics", None)
    if metrics is not None and type(metrics).__name__ != "NoOpTracerMetrics":
        return None
    return tracer


def light_tracer(tracer: Any) -> sdk_trace.Tracer | None:
    """The SDK tracer behind `tracer` if a `LightSpan` is exactly what it would start now (its
    processors can change); None with the fast paths off. The tracer is the SDK's own class, enabled,
    without self-metrics, and its processors all have the stock no-op `on_start` (the SDK's batch and
    simple processors, and subclasses that keep it)."""
    global _resolved
    if not _FAST[0]:
        return None
    given, sdk, is_enabled = _resolved
    if given is not tracer:
        sdk = _resolve(tracer)
        is_enabled = getattr(sdk, "_is_enabled", None)
        if sdk is not None or getattr(tracer, "_real_tracer", tracer) is not None:  # a proxy may resolve later
            _resolved = (tracer, sdk, is_enabled)
    if sdk is None or (is_enabled is not None and not is_enabled()):
        return None
    processors = getattr(sdk.span_processor, "_span_processors", None)
    checked, verdict = _eligible
    if processors is not checked:
        verdict = _processors_eligible(processors)
    return sdk if verdict else None


# ---- LightSpan: the SDK's ReadableSpan fields (the same from SDK 1.27 to 1.45) ----

_LOCK = threading.Lock()  # guards every LightSpan's rare mutations (events, status, foreign attributes)
_SYNCHRONOUS = sdk_trace.SynchronousMultiSpanProcessor  # the provider's, unless given another
_UNSET = Status(StatusCode.UNSET)  # immutable, shared as a new span's status


class LightSpan(trace.Span, ReadableSpan):
    """A recording span that is also the SDK's `ReadableSpan` it ends as (see `core.light_span`).

    As the SDK's own span, it is handed to the span processors itself at `end()`: it has the
    `ReadableSpan` fields (`_name`, `_context`, `_start_time`, ...; the same from SDK 1.27 to 1.45)
    and its properties. After `end()` nothing changes it."""

    __slots__ = (
        "_attributes",
        "_context",
        "_end_time",
        "_ended",
        "_events",
        "_foreign",
        "_instrumentation_info",
        "_instrumentation_scope",
        "_kind",
        "_links",
        "_name",
        "_parent",
        "_resource",
        "_start_time",
        "_status",
        "_tracer",
    )  # fmt: skip

    def __init__(  # not ReadableSpan's: its fields are set here, some from the tracer
        self,
        tracer: sdk_trace.Tracer,
        name: str,
        kind: SpanKind,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: dict[str, Any],
        start_time: int,
    ) -> None:
        self._tracer = tracer
        self._name = name
        self._kind = kind
        self._context: SpanContext = context
        self._parent = parent
        self._attributes: Mapping[str, Any] = attributes
        self._foreign = False  # set by code other than stallwatch: cleaned and bounded at the end
        self._events: Sequence[sdk_trace.Event] = ()  # a BoundedList from the first event (oldest dropped)
        self._links: Sequence[Link] = ()
        self._status = _UNSET
        self._start_time = start_time
        self._end_time: int | None = None
        self._ended = False
        self._resource = tracer.resource
        self._instrumentation_info = tracer.instrumentation_info
        self._instrumentation_scope = tracer._instrumentation_scope

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._ended

    def set_own_attributes(self, attributes: dict[str, Any]) -> None:
        """stallwatch's own attributes: already valid values, set just before `end()`."""
        self._attributes.update(attributes)  # type: ignore[attr-defined]  # the dict given at start

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        with _LOCK:
            if not self._ended:
                self._attributes.update(attributes)  # type: ignore[attr-defined]  # a dict until `end()`
                self._foreign = True

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        self.set_attributes({key: value})

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        limits = self._tracer._span_limits
        bounded = BoundedAttributes(limits.max_event_attributes, attributes, max_value_len=limits.max_attribute_length)
        self._append("_events", limits.max_events, sdk_trace.Event(name, bounded, timestamp or time_ns()))

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if not context.is_valid:
            return
        limits = self._tracer._span_limits
        bounded = BoundedAttributes(limits.max_link_attributes, attributes, max_value_len=limits.max_attribute_length)
        self._append("_links", limits.max_links, Link(context, bounded))

    def _append(self, field: str, maxlen: int | None, item: Any) -> None:
        """Append `item` to the events or links `field` unless the span has ended: the empty tuple it
        starts with becomes a `BoundedList` of `maxlen` (oldest dropped) on the first append."""
        with _LOCK:
            if self._ended:
                return
            items = getattr(self, field)
            if type(items) is tuple:
                items = BoundedList(maxlen)
                setattr(self, field, items)
            items.append(item)

    def update_name(self, name: str) -> None:
        with _LOCK:
            if not self._ended:
                self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        with _LOCK:
            if self._ended or self._status.status_code is StatusCode.OK:  # OK is final, as in the SDK
                return
            if isinstance(status, Status):
                self._status = status
            elif status is not StatusCode.UNSET:
                self._status = Status(status, description if status is StatusCode.ERROR else None)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        module, qualname = type(exception).__module__, type(exception).__qualname__
        event: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        event.update(attributes or {})
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        with _LOCK:
            if self._ended:
                return
            self._ended = True
        self._end_time = end_time if end_time is not None else time_ns()
        self._hand_off()

    def end_own(self, attributes: dict[str, Any]) -> None:
        """`set_own_attributes(attributes)` then `end()` as one step under the span's lock: nothing once the
        span has ended, whoever ended it (the attributes of a span handed to the processors never change)."""
        with _LOCK:
            if self._ended:
                return
            self._ended = True
            self._attributes.update(attributes)  # type: ignore[attr-defined]  # the dict given at start
        self._end_time = time_ns()
        self._hand_off()

    def end_as_built(self, end_time: int, status: Status | None) -> None:
        """End a span nothing else has seen yet (just built, never handed out) with `status` (None: unset):
        what `set_status(status)` then `end(end_time)` do, without the lock."""
        self._ended = True
        self._end_time = end_time
        if status is not None:
            self._status = status
        self._hand_off()

    def _hand_off(self) -> None:
        """The ended span to every span processor, its attributes bounded first if they must be."""
        tracer = self._tracer
        limits = tracer._span_limits
        if self._foreign or limits.max_span_attribute_length is not None:
            self._attributes = BoundedAttributes(
                limits.max_span_attributes,
                self._attributes,
                immutable=True,
                max_value_len=limits.max_span_attribute_length,
            )
        processor = tracer.span_processor
        if type(processor) is _SYNCHRONOUS:  # its `on_end`, one frame fewer: each processor's, in order
            for each in processor._span_processors:
                each.on_end(self)
        else:
            processor.on_end(self)


# Span types whose `ReadableSpan` fields are read directly: the SDK's finished span and `LightSpan`.
FIELD_READABLE: frozenset[type] = frozenset({ReadableSpan, LightSpan})
# Every span type the SDK and stallwatch hand out, told without `isinstance` against the API's abstract `Span`
SPAN_TYPES: frozenset[type] = frozenset({sdk_trace.Span, sdk_trace._Span, LightSpan, trace.NonRecordingSpan})


def span_fields(span: Any) -> tuple[Any, ...]:
    """(context, parent, name, kind, start time, end time, attributes, events, links, status) of a
    finished `ReadableSpan`, read from its fields: attributes, events and links as stored (a dict or
    `BoundedAttributes`, a tuple or `BoundedList`)."""
    return (
        span._context, span._parent, span._name, span._kind, span._start_time, span._end_time,
        span._attributes, span._events, span._links, span._status,
    )  # fmt: skip


def readable_fields(span: Any) -> tuple[Any, ...] | None:
    """`span_fields(span)` when `span` is of a `FIELD_READABLE` type and the fast paths are on, else
    None (read the properties)."""
    return span_fields(span) if _FAST[0] and type(span) in FIELD_READABLE else None


def span_sampled(span: Any) -> bool:
    """`span.context.trace_flags.sampled`, for a `FIELD_READABLE` span with the fast paths on read from
    the `SpanContext` tuple in its fields rather than through three properties. A span given no context
    is not sampled, or raises where the SDK's own processors do (`CONTEXTLESS_SPAN_RAISES`)."""
    if _FAST[0] and type(span) in FIELD_READABLE:
        context = span._context
        if context is not None:
            return context[3] & TraceFlags.SAMPLED != 0
    else:
        context = span.context
        if context is not None:
            return bool(context.trace_flags.sampled)
    if CONTEXTLESS_SPAN_RAISES:
        raise AttributeError("'NoneType' object has no attribute 'trace_flags'")  # the SDK's, word for word
    return False


def span_origin(span: Any) -> tuple[Any, Any]:
    """(resource, instrumentation scope) of a finished span, from its fields when it has them."""
    if _FAST[0] and type(span) in FIELD_READABLE:
        return span._resource, span._instrumentation_scope
    return span.resource, span.instrumentation_scope


def exit_check_fields(span: Any, scope_name: str) -> tuple[Any, Any, Any, Any, Any] | None:
    """(name, attributes, events, links, status) of a finished span of the instrumentation scope `scope_name`,
    or None for anything else (another scope, or not a `ReadableSpan`): what the exit check reads, with one
    call. From the fields of a `FIELD_READABLE` span with the fast paths on (attributes, events and links as
    stored); otherwise from the public properties (a read-only view of the attributes, tuples of the events
    and links), whatever the span's type."""
    if _FAST[0] and type(span) in FIELD_READABLE:
        scope = span._instrumentation_scope
        if scope is None or scope.name != scope_name:
            return None
        return span._name, span._attributes, span._events, span._links, span._status
    if not isinstance(span, ReadableSpan):
        return None
    scope = span.instrumentation_scope
    if scope is None or scope.name != scope_name:
        return None
    return span.name, span.attributes, span.events, span.links, span.status


def own_attributes(span: Any) -> dict[str, Any] | None:
    """The attribute dict a `LightSpan` was started with (stallwatch may add valid values to it
    before `end()`), or None for any other span."""
    return cast("dict[str, Any]", span._attributes) if type(span) is LightSpan else None


def take_attributes(span: LightSpan, attributes: dict[str, Any]) -> None:
    """Make `attributes` (valid values, set by stallwatch) the attribute dict of a `LightSpan` not ended yet."""
    span._attributes = attributes


def replaced_span(
    span: ReadableSpan, name: str, attributes: Any, events: Any, links: Any, status: Status | None
) -> ReadableSpan:
    """A copy of the finished `span` with these fields; the rest, and the counts of attributes, events and
    links the span dropped, are the span's own.

    With the fast paths on and a `FIELD_READABLE` span: `copy.copy` (the same type) with the fields set, events
    and links that differ from the stored ones as `BoundedList`s carrying the dropped counts. Otherwise a
    `ReadableSpan` built by its public constructor from the span's public properties, attributes, events and
    links as the SDK's bounded containers carrying the dropped counts (the instrumentation info, deprecated
    for the scope, is not carried)."""
    if _FAST[0] and type(span) in FIELD_READABLE:
        import copy

        clone = copy.copy(span)
        clone._name, clone._attributes, clone._status = name, attributes, status  # type: ignore[assignment]
        clone._events = events if events is span._events else _bounded_list(events, span.dropped_events)
        clone._links = links if links is span._links else _bounded_list(links, span.dropped_links)
        return clone
    bounded = BoundedAttributes(None, attributes, immutable=True)
    bounded.dropped = span.dropped_attributes
    return ReadableSpan(
        name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=bounded,
        events=_bounded_list(events, span.dropped_events),
        links=_bounded_list(links, span.dropped_links),
        kind=span.kind,
        status=status,  # type: ignore[arg-type]  # a ReadableSpan may be given no status
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def _bounded_list(items: Sequence[Any], dropped: int) -> BoundedList:
    """`items` in a `BoundedList` (no bound: a finished span's) that says `dropped` were dropped: what the
    span's `dropped_events` / `dropped_links` read."""
    bounded = BoundedList.from_seq(None, items)
    bounded.dropped = dropped
    return bounded


# ---- context ----

_context_var: Any = getattr(otel_context._RUNTIME_CONTEXT, "_current_context", None)


def context_var() -> contextvars.ContextVar[Any] | None:
    """The one `ContextVar` of `ContextVarsRuntimeContext`, the runtime context the API ships (1.27 to
    1.45): `get_current()`, `attach()` and `detach()` read and set it through two Python frames each.
    None with the fast paths off or another runtime context (OTEL_PYTHON_CONTEXT)."""
    if not _FAST[0] or not isinstance(_context_var, contextvars.ContextVar):
        return None
    return _context_var


_tracked: tuple[Any, ...] | None = None  # the original attach/detach and ours, while ours are in place


def note_context_changes(on_change: Callable[[Any], None]) -> bool:
    """Call `on_change(context or None)` after every `opentelemetry.context.attach(context)` (with it)
    and `detach()` (with None), in the thread that made it; False (nothing done) with the fast paths off.

    The module's `attach`/`detach` are replaced (`use_span` and `start_as_current_span` call them
    through the module) by plain functions around them, not wrapt wrappers: they run twice per span.
    `stop_noting_context_changes()` puts them back."""
    global _tracked
    if not _FAST[0]:
        return False
    if _tracked is not None:
        return True
    attach, detach = otel_context.attach, otel_context.detach

    def attach_noted(context: Any) -> Any:
        token = attach(context)
        on_change(context)
        return token

    def detach_noted(token: Any) -> None:
        detach(token)
        on_change(None)

    otel_context.attach, otel_context.detach = attach_noted, detach_noted
    _tracked = (attach, detach, attach_noted, detach_noted)
    return True


def stop_noting_context_changes() -> None:
    """Put `opentelemetry.context.attach`/`detach` back, unless something replaced ours since."""
    global _tracked
    if _tracked is None:
        return
    attach, detach, attach_noted, detach_noted = _tracked
    if otel_context.attach is attach_noted and otel_context.detach is detach_noted:
        otel_context.attach, otel_context.detach = attach, detach
    _tracked = None


SPAN_KEY = trace.propagation._SPAN_KEY  # the context key of the current span (API 1.27 to 1.45)


def span_in(context: otel_context.Context) -> Any:
    """The span `context` holds, or None (read as `trace.get_current_span(context)` does, without its
    two calls; with the fast paths off, through it)."""
    if not _FAST[0]:
        span = trace.get_current_span(context)
        return None if span is trace.INVALID_SPAN else span
    current = context.get(SPAN_KEY)
    if current is None or not (type(current) in SPAN_TYPES or isinstance(current, trace.Span)):
        return None
    return current


def sampled_parent(context: otel_context.Context) -> SpanContext | None:
    """The span context of the span `context` holds when it is valid and sampled, else None: what
    `trace.get_current_span(context).get_span_context()`, its `is_valid` and `trace_flags.sampled` tell.
    With the fast paths on, read from the span's field and the `SpanContext` tuple (for the SDK's and
    stallwatch's span types, whose `get_span_context` returns that field), without their calls."""
    if not _FAST[0]:
        parent = trace.get_current_span(context).get_span_context()
        return parent if parent.is_valid and parent.trace_flags.sampled else None
    current: Any = context.get(SPAN_KEY)
    if current is None:
        return None
    if type(current) in SPAN_TYPES:
        parent = current._context
    elif isinstance(current, trace.Span):
        parent = current.get_span_context()
    else:
        return None
    return parent if parent[5] and parent[3] & TraceFlags.SAMPLED else None


def with_span(context: otel_context.Context, span: Any) -> otel_context.Context:
    """`trace.set_span_in_context(span, context)`; with the fast paths on, with one copy of the context,
    not two (`set_value` copies it, then `Context()` copies that): the key is set in the copy, which
    nothing else holds yet, past the immutable Context's `__setitem__` (a dict's, API 1.27 to 1.45)."""
    if not _FAST[0]:
        return trace.set_span_in_context(span, context)
    copied = otel_context.Context(context)
    dict.__setitem__(copied, SPAN_KEY, span)
    return copied


# ---- logs, metrics, exporters ----


def encode_logs(batch: Sequence[Any]) -> Any:
    """The SDK's OTLP log encoder (`ExportLogsServiceRequest`), in a private module from 1.27 to 1.45;
    loaded on first use (its module reads nothing at import, but costs the import)."""
    from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs as sdk_encode_logs

    return sdk_encode_logs(batch)


def base_configurator() -> type:
    """The SDK's configurator base class, which `opentelemetry-instrument` loads configurators by (a
    private module, 1.27 to 1.45); imported only by the entry point, never at `import stallwatch`."""
    from opentelemetry.sdk._configuration import _BaseConfigurator

    return _BaseConfigurator


def checked_logger(logger: Any, wrap: Callable[[Any], Any], wrapper_type: type) -> None:
    """Give the SDK `logger` the log record processor `wrap(its own)`, unless it is a `wrapper_type`."""
    processor = getattr(logger, "_multi_log_record_processor", None)
    if processor is not None and type(processor) is not wrapper_type:
        logger._multi_log_record_processor = wrap(processor)


_by_logger: list[Callable[[str], bool]] = []
_RECORD_LOGGERS_MAX = 64  # loggers a handler keeps by name: stallwatch's own loggers are a few


def emit_through_record_loggers(own: Callable[[str], bool]) -> None:
    """Make each `LoggingHandler` emit a record whose logger name `own` accepts through a logger of the
    provider's named after it (that name its scope), as the SDK does for every record since 1.28. Up to 1.27
    the handler emits every record through one logger of its own, scoped by the SDK module's name: the exit
    check, which knows stallwatch's records by their scope, would pass them unchecked. Other records, and
    every record on the later SDKs, are emitted as the SDK emits them. Installed once per process.

    The provider of 1.27 builds a new logger at each `get_logger`: each handler keeps the one it got per
    name (its provider is its own for its lifetime), up to `_RECORD_LOGGERS_MAX` names, and asks the
    provider at each record beyond them."""
    from opentelemetry.sdk import _logs as sdk_logs

    if _by_logger or "_logger" not in sdk_logs.LoggingHandler.emit.__code__.co_names:
        return
    _by_logger.append(own)
    wrapt.wrap_function_wrapper(sdk_logs, "LoggingHandler.emit", _emit_through_record_logger)


def _emit_through_record_logger(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    from opentelemetry._logs import NoOpLogger

    record = args[0] if args else kwargs["record"]
    name = getattr(record, "name", None)
    if type(name) is not str or isinstance(instance._logger, NoOpLogger) or not _by_logger[0](name):
        return wrapped(*args, **kwargs)
    loggers: dict[str, Any] | None = instance.__dict__.get("_stallwatch_record_loggers")
    if loggers is None:
        loggers = instance.__dict__["_stallwatch_record_loggers"] = {}
    logger = loggers.get(name)
    if logger is None:
        logger = instance._logger_provider.get_logger(name)
        if len(loggers) < _RECORD_LOGGERS_MAX:
            loggers[name] = logger
    if not isinstance(logger, NoOpLogger):
        logger.emit(instance._translate(record))


def histogram_temporalities(reader: Any) -> list[Any]:
    """The temporalities a metric reader wants for histograms: it keys them by instrument class,
    `Histogram` on recent SDKs, the internal `_Histogram` on older ones."""
    return [
        temporality
        for cls, temporality in getattr(reader, "_instrument_class_temporality", {}).items()
        if cls.__name__.lstrip("_") == "Histogram"
    ]


def prometheus_reader_class(base: type, feed: Callable[[Any], Any], doc: str) -> type:
    """A subclass of the `PrometheusMetricReader` class `base` whose collected data passes through
    `feed` (metrics data in, metrics data out) before its collector turns it into families."""

    def _receive_metrics(self: Any, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        base._receive_metrics(self, feed(metrics_data), timeout_millis, **kwargs)  # type: ignore[attr-defined]

    return type("Reader", (base,), {"_receive_metrics": _receive_metrics, "__doc__": doc, "__module__": __name__})


def with_encoder(exporter_class: type, global_name: str, make: Callable[[Any], Any]) -> type:
    """A subclass of an SDK OTLP/HTTP exporter whose methods that call the SDK encoder `global_name`
    (`export`, or `_serialize_spans` in SDK 1.27) call `make(<the SDK's encoder>)` instead: the same
    code, run with that one global replaced. The class itself if no method calls it, or with the fast
    paths off."""
    if not _FAST[0]:
        return exporter_class
    replaced: dict[str, Any] = {}
    for name in ("export", "_serialize_spans"):
        method = getattr(exporter_class, name, None)
        if isinstance(method, pytypes.FunctionType) and global_name in method.__code__.co_names:
            namespace = dict(method.__globals__)
            namespace[global_name] = make(method.__globals__[global_name])
            function = pytypes.FunctionType(method.__code__, namespace, name, method.__defaults__, method.__closure__)
            function.__kwdefaults__ = method.__kwdefaults__
            function.__qualname__ = method.__qualname__
            replaced[name] = function
    if not replaced:
        return exporter_class
    return type(exporter_class.__name__, (exporter_class,), {**replaced, "__module__": exporter_class.__module__})


def encode_once(exporter_class: type) -> type:
    """A subclass of the SDK's OTLP/gRPC `exporter_class` that encodes each batch once per export, not
    once per retry; the class itself with the fast paths off.

    The SDK's gRPC exporters (1.27 to 1.45) call `_translate_data(batch)` inside their retry loop, so
    every retry of an export the collector answered with a retryable code encodes the whole batch
    again, on the export thread, under the GIL the host's threads need; no setting changes that.
    `_translate_data` returns the request it already built for the same batch object during the same
    `_export` call. The request is dropped when the call returns, so no batch is kept between exports;
    a batch that is not the one kept (the shutdown's flush beside the batch worker) is encoded as before.
    """
    if not _FAST[0]:
        return exporter_class

    class EncodeOnce(exporter_class):
        _stallwatch_encoded: tuple[Any, Any] | None = None  # (batch, request) of the export under way

        def _translate_data(self, data: Any) -> Any:
            encoded = self._stallwatch_encoded
            if encoded is not None and encoded[0] is data:
                return encoded[1]
            request = super()._translate_data(data)
            self._stallwatch_encoded = (data, request)
            return request

        def _export(self, data: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return super()._export(data, *args, **kwargs)
            finally:
                self._stallwatch_encoded = None

    EncodeOnce.__name__ = EncodeOnce.__qualname__ = exporter_class.__name__
    EncodeOnce.__module__ = exporter_class.__module__
    return EncodeOnce


def proxy_providers() -> tuple[type, type, type]:
    """The API's placeholder tracer, meter and logger provider classes, what `get_*_provider()` returns
    before a provider is set (the meter's and the logger's in private modules, API 1.27 to 1.45)."""
    from opentelemetry import _logs, metrics

    return trace.ProxyTracerProvider, metrics._internal._ProxyMeterProvider, _logs._internal.ProxyLoggerProvider


def exporter_preferences(exporter: Any) -> tuple[Any, Any]:
    """(preferred temporality, preferred aggregation) an SDK `MetricExporter` was built with: its
    reader reads them from these fields (1.27 to 1.45); the constructor takes them, nothing gives them."""
    return exporter._preferred_temporality, exporter._preferred_aggregation


def otlp_http_metric_preferences() -> tuple[Any, Any] | None:
    """(preferred temporality, preferred aggregation) the OTLP/HTTP metric exporter would be built with
    from the environment, without building it (which loads its modules, protobuf and `requests`); None
    where that is not known without building it. Exporter 1.45 computes both with the functions of
    `opentelemetry.exporter.otlp.common._aggregation`; earlier ones with their own mixin's methods.
    A fast path (private functions): None with the fast paths off, and the exporter is built at once."""
    if not _FAST[0]:
        return None
    try:
        # footprint: the exporter package's __init__ and its version, not the exporter
        from opentelemetry.exporter.otlp.proto.http import __version__ as http_version

        major, minor = (int(part) for part in http_version.split(".")[:2])
        if (major, minor) < (1, 45):
            return None
        from opentelemetry.exporter.otlp.common._aggregation import _get_aggregation, _get_temporality
    except Exception:
        return None
    return _get_temporality(None), _get_aggregation(None)


def immutable(attributes: BoundedAttributes) -> bool:
    """Whether a `BoundedAttributes` refuses changes: a log record's stay open to the processors after
    the one that reads them, a finished span's are closed (API 1.27 to 1.45; True if unknown)."""
    return bool(getattr(attributes, "_immutable", True))


def metric_readers(meter_provider: Any) -> Sequence[Any]:
    """The metric readers an SDK `MeterProvider` was built with, or none: a private field of the
    provider on the SDKs that can add readers later (1.45), of its private configuration before."""
    readers: Sequence[Any] | None = getattr(meter_provider, "_metric_readers", None)
    if readers is None:
        return getattr(getattr(meter_provider, "_sdk_config", None), "metric_readers", ())
    return readers
