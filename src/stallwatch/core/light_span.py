"""Spans for hot paths (executor work items, child processes, Nebius calls), built as the SDK would, cheaper.

A `LightSpan` takes the same decisions as the SDK's span from the same parts of the tracer (its
sampler, id generator, resource, scope, limits and span processor), keeps only what is set on it,
and is itself the `ReadableSpan` the SDK would hand the processors at `end()`.

Contract: used only where that is exactly equivalent, an SDK `Tracer` that records no self-metrics
and whose processors all have the stock no-op `on_start`; anywhere else `start()` returns the
tracer's own span. With the default parent-based sampler and a sampled local parent the sampler's
answer is known and it is not called. What is exported is the same; `on_start` is never called (it
does nothing on the processors accepted); attribute values set by other code are cleaned and bounded
at `end()` rather than when set. Uses SDK internals: `ReadableSpan`'s fields (the same from SDK 1.27
to 1.45) and the `SpanContext` tuple's layout.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from time import time_ns
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import ReadableSpan, sampling
from opentelemetry.sdk.trace import export as sdk_export
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util import types

from .faults import first_record

_LOCK = threading.Lock()  # guards every LightSpan's rare mutations (events, status, foreign attributes)
_STOCK = (sdk_trace.SpanProcessor, sdk_export.BatchSpanProcessor, sdk_export.SimpleSpanProcessor)
_NO_OP_ON_START = frozenset(stock.on_start for stock in _STOCK)  # each is `pass`
_NO_OP_ON_ENDING = frozenset(getattr(stock, "_on_ending", None) for stock in _STOCK)  # SDK 1.45+; `pass`
_eligible: tuple[object, bool] = (object(), False)  # (the processors tuple last checked, its verdict)


def _processors_eligible(processors: Any) -> bool:
    """True when starting a span would call no processor code (`on_start` and `_on_ending` no-ops)."""
    global _eligible
    verdict = processors is not None and all(
        type(p).on_start in _NO_OP_ON_START and getattr(type(p), "_on_ending", None) in _NO_OP_ON_ENDING
        for p in processors
    )
    _eligible = (processors, verdict)
    return verdict


# (tracer given, SDK tracer fit for this path, its `_is_enabled` or None)
_resolved: tuple[object, sdk_trace.Tracer | None, Any] = (None, None, None)
_PARENT_BASED = (sampling.ParentBased, sampling.ParentBasedTraceIdRatio)  # exact types: a subclass may decide otherwise
_SYNCHRONOUS = sdk_trace.SynchronousMultiSpanProcessor  # the provider's, unless given another
_UNSET = Status(StatusCode.UNSET)  # immutable, shared as a new span's status


def _resolve(tracer: Any) -> sdk_trace.Tracer | None:
    tracer = getattr(tracer, "_real_tracer", None) or tracer  # a global ProxyTracer resolves to it
    if type(tracer) is not sdk_trace.Tracer:
        return None
    metrics = getattr(tracer, "_tracer_metrics", None)
    if metrics is not None and type(metrics).__name__ != "NoOpTracerMetrics":
        return None
    return tracer


def _sdk_tracer(tracer: Any) -> sdk_trace.Tracer | None:
    """The SDK tracer behind `tracer` if the light path fits it now (its processors can change)."""
    global _resolved
    given, sdk, is_enabled = _resolved
    if given is not tracer:
        sdk = _resolve(tracer)
        is_enabled = getattr(sdk, "_is_enabled", None)  # SDK 1.45+: the tracer configurator may disable it
        if sdk is not None or getattr(tracer, "_real_tracer", tracer) is not None:  # a proxy may resolve later
            _resolved = (tracer, sdk, is_enabled)
    if sdk is None or (is_enabled is not None and not is_enabled()):
        return None
    processors = getattr(sdk.span_processor, "_span_processors", None)
    checked, verdict = _eligible
    if processors is not checked:
        verdict = _processors_eligible(processors)
    return sdk if verdict else None


_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # W3C trace-context level 2 flag, SDK 1.45+
_SAMPLED = TraceFlags.SAMPLED
_NO_PARENT = (0, 0, False, 0, None, False)
_TRACE_FLAGS = tuple(TraceFlags(flags) for flags in range(256))  # immutable: shared, as flag values repeat
_TRACE_ID_MAX, _SPAN_ID_MAX = 2**128 - 1, 2**64 - 1  # as the API bounds ids
_new_tuple = tuple.__new__


def _span_context(trace_id: int, span_id: int, flags: int, trace_state: trace.TraceState | None) -> SpanContext:
    """`SpanContext(trace_id, span_id, False, TraceFlags(flags), trace_state)`, the tuple its `__new__`
    builds (API 1.27 to 1.45: `test_light_span` compares the two), in a third of the time."""
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


# (trace id, trace flags, parent or None, trace state, attributes to record, recording)
Decision = tuple[int, int, "SpanContext | None", "trace.TraceState | None", dict[str, Any], bool]


class ShedSpan(trace.NonRecordingSpan):
    """A sampled span stallwatch did not record because nothing would have exported it (`export.shedding`).

    Its own type, so that measurements made inside it offer no exemplar (an exemplar would link to a
    span that never reaches the backend); otherwise the API's `NonRecordingSpan`."""


def non_recording(sdk: sdk_trace.Tracer, decision: Decision, shed: bool = False) -> trace.NonRecordingSpan:
    """The span the SDK hands out for a span it does not record, with a new span id (`ShedSpan` if `shed`)."""
    trace_id, flags, _, trace_state, _, _ = decision
    context = _span_context(trace_id, sdk.id_generator.generate_span_id(), flags, trace_state)
    return ShedSpan(context) if shed else trace.NonRecordingSpan(context)


def decide(
    sdk: sdk_trace.Tracer,
    name: str,
    context: otel_context.Context | None,
    attributes: types.Attributes,
    kind: SpanKind,
    links: Any,
    parent: SpanContext | None,
) -> Decision:
    """Trace id, flags, trace state and attributes of a new span, as `sdk.start_span` takes them.

    `parent`: the span context current in `context`, when the caller has looked it up already."""
    if parent is None:
        parent = trace.get_current_span(context).get_span_context()
    # The SpanContext tuple unpacked at once, not through six properties (its layout: see `_span_context`)
    parent_trace_id, _, parent_remote, parent_flags, parent_state, parent_valid = parent or _NO_PARENT
    if parent_valid:
        trace_id, flags = parent_trace_id, parent_flags & _RANDOM
    else:
        parent, trace_id = None, sdk.id_generator.generate_trace_id()
        random = getattr(sdk.id_generator, "is_trace_id_random", None)
        flags = _RANDOM if _RANDOM and random is not None and random() else 0
    sampler = sdk.sampler
    if type(sampler) not in _PARENT_BASED:
        delegate = None
    elif parent is None:  # a ParentBased sampler below (its type checked): its private delegates
        delegate = sampler._root  # type: ignore[attr-defined]
    elif parent_flags & _SAMPLED:
        delegate = sampler._remote_parent_sampled if parent_remote else sampler._local_parent_sampled  # type: ignore[attr-defined]
    else:
        delegate = None
    if delegate is sampling.ALWAYS_ON:  # what the sampler would answer, without its three calls and result object
        trace_state = parent_state if parent is not None else None
        return trace_id, flags | _SAMPLED, parent, trace_state, dict(attributes or {}), True
    result = sampler.should_sample(context, trace_id, name, kind, attributes, links)
    if result.decision.is_sampled():
        flags |= _SAMPLED
    recording = result.decision.is_recording()
    return trace_id, flags, parent, result.trace_state, dict(result.attributes or {}), recording


def _never_shed(processors: Sequence[Any]) -> bool:
    return False


_shed: Callable[[Sequence[Any]], bool] = _never_shed


def shed_with(check: Callable[[Sequence[Any]], bool]) -> None:
    """Make `start(..., shed=True)` ask `check(span_processors)` whether every span processor would
    drop a sampled span now (and count it when so). Set by the export layer, which owns those processors."""
    global _shed
    _shed = check


def start(
    tracer: trace.Tracer,
    name: str,
    context: otel_context.Context | None,
    attributes: dict[str, Any],
    kind: SpanKind = SpanKind.INTERNAL,
    start_time: int | None = None,
    parent: SpanContext | None = None,
    shed: bool = False,
) -> trace.Span:
    """Start a span as `tracer.start_span(name, context, kind, attributes, start_time=...)` would;
    `parent`: the span context current in `context`, when the caller has looked it up already.
    `attributes` is copied, never kept nor changed: a caller may pass the same dict every time.
    `shed`: a sampled span that every span processor would drop now is not recorded
    (`shed_with`); not for spans the journal must see in flight."""
    sdk = _sdk_tracer(tracer)
    if sdk is None:
        first_record()
        return tracer.start_span(name, context=context, kind=kind, attributes=attributes, start_time=start_time)
    sampler = sdk.sampler
    trace_state: trace.TraceState | None
    if parent is not None:
        parent_trace_id, _, parent_remote, parent_flags, parent_state, parent_valid = parent  # the tuple's layout
    if (
        parent is not None
        and parent_valid
        and parent_flags & _SAMPLED
        and not parent_remote
        and type(sampler) in _PARENT_BASED
        and sampler._local_parent_sampled is sampling.ALWAYS_ON  # type: ignore[attr-defined]  # a ParentBased
    ):  # a sampled local parent and the default sampler: `decide`'s known answer, without the call
        trace_id, flags, trace_state = parent_trace_id, parent_flags & _RANDOM | _SAMPLED, parent_state
        span_attributes = dict(attributes)
    else:
        decision = decide(sdk, name, context, attributes, kind, (), parent)
        trace_id, flags, parent, trace_state, span_attributes, recording = decision
        if not recording:
            return non_recording(sdk, decision)
    if shed and flags & _SAMPLED and _shed(sdk.span_processor._span_processors):
        return non_recording(sdk, (trace_id, flags, parent, trace_state, span_attributes, True), shed=True)
    span_context = _span_context(trace_id, sdk.id_generator.generate_span_id(), flags, trace_state)
    return LightSpan(sdk, name, kind, span_context, parent, span_attributes, start_time or time_ns())


class LightSpan(trace.Span, ReadableSpan):
    """A recording span that is also the SDK's `ReadableSpan` it ends as (see the module docstring).

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
        with _LOCK:
            if self._ended:
                return
            if type(self._events) is tuple:
                self._events = BoundedList(limits.max_events)
            self._events.append(sdk_trace.Event(name, bounded, timestamp or time_ns()))  # type: ignore[attr-defined]  # a BoundedList

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if not context.is_valid:
            return
        limits = self._tracer._span_limits
        bounded = BoundedAttributes(limits.max_link_attributes, attributes, max_value_len=limits.max_attribute_length)
        with _LOCK:
            if self._ended:
                return
            if type(self._links) is tuple:
                self._links = BoundedList(limits.max_links)
            self._links.append(Link(context, bounded))  # type: ignore[attr-defined]  # a BoundedList

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
