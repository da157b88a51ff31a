"""Spans for hot paths (executor work items, child processes, Nebius calls), built as the SDK would, cheaper.

A `LightSpan` takes the same decisions as the SDK's span from the same parts of the tracer (its
sampler, id generator, resource, scope, limits and span processor), keeps only what is set on it,
and is itself the `ReadableSpan` the SDK would hand the processors at `end()`. `finish` makes the span
of work already over (start, attributes, status and end known at once) as one built ended.

Contract: used only where that is exactly equivalent, an SDK `Tracer` that records no self-metrics
and whose processors all have the stock no-op `on_start`; anywhere else `start()` returns the
tracer's own span. With the default parent-based sampler and a sampled local parent the sampler's
answer is known and it is not called. What is exported is the same; `on_start` is never called (it
does nothing on the processors accepted); attribute values set by other code are cleaned and bounded
at `end()` rather than when set. The SDK's private names and layouts it relies on (the `LightSpan`
class, the `SpanContext` tuple) are in `sdk_compat`; with `STALLWATCH_FAST_PATHS=false`, `start()`
always returns the tracer's own span.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import time_ns
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import sampling
from opentelemetry.trace import SpanContext, SpanKind, Status, TraceFlags
from opentelemetry.util import types

from .. import sdk_compat
from ..sdk_compat import LightSpan
from .faults import first_record

__all__ = ["LightSpan", "ShedSpan", "decide", "finish", "non_recording", "start"]

_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # W3C trace-context level 2 flag, SDK 1.45+
_SAMPLED = TraceFlags.SAMPLED


# (trace id, trace flags, parent or None, trace state, attributes to record, recording)
Decision = tuple[int, int, "SpanContext | None", "trace.TraceState | None", dict[str, Any], bool]


class ShedSpan(trace.NonRecordingSpan):
    """A sampled span stallwatch did not record because nothing would have exported it (`export.shedding`).

    Its own type, so that measurements made inside it offer no exemplar (an exemplar would link to a
    span that never reaches the backend); otherwise the API's `NonRecordingSpan`."""


def non_recording(sdk: sdk_trace.Tracer, decision: Decision, shed: bool = False) -> trace.NonRecordingSpan:
    """The span the SDK hands out for a span it does not record, with a new span id (`ShedSpan` if `shed`)."""
    trace_id, flags, _, trace_state, _, _ = decision
    context = sdk_compat.new_span_context(trace_id, sdk.id_generator.generate_span_id(), flags, trace_state)
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
    parent_trace_id, _, parent_remote, parent_flags, parent_state, parent_valid = sdk_compat.span_context_fields(parent)
    if parent_valid:
        trace_id, flags = parent_trace_id, parent_flags & _RANDOM
    else:
        parent, trace_id = None, sdk.id_generator.generate_trace_id()
        random = getattr(sdk.id_generator, "is_trace_id_random", None)
        flags = _RANDOM if _RANDOM and random is not None and random() else 0
    sampler = sdk.sampler
    sampled_parent = bool(parent_flags & _SAMPLED)
    delegate = sdk_compat.parent_based_delegate(sampler, parent is not None, sampled_parent, parent_remote)
    if delegate is sampling.ALWAYS_ON:  # what the sampler would answer, without its three calls and result object
        trace_state = parent_state if parent is not None else None
        return trace_id, flags | _SAMPLED, parent, trace_state, dict(attributes or {}), True
    result = sampler.should_sample(context, trace_id, name, kind, attributes, links)
    if result.decision.is_sampled():
        flags |= _SAMPLED
    recording = result.decision.is_recording()
    return trace_id, flags, parent, result.trace_state, dict(result.attributes or {}), recording


def _never_shedding(processors: Sequence[Any] | None) -> list[str] | None:
    return None


def _never_counted(processors: Sequence[Any], reasons: Sequence[str]) -> None:
    return None


_shedding: Callable[[Sequence[Any] | None], list[str] | None] = _never_shedding
_count_shed: Callable[[Sequence[Any], Sequence[str]], None] = _never_counted


def shed_with(
    shedding: Callable[[Sequence[Any] | None], list[str] | None],
    count_shed: Callable[[Sequence[Any], Sequence[str]], None],
) -> None:
    """Make `start(..., shed=True)` ask `shedding(span_processors)` why every span processor would drop
    a sampled span now (None: one would keep it), and `count_shed(span_processors, reasons)` when so.
    Set by the export layer, which owns those processors; its tracers ask the same."""
    global _shedding, _count_shed
    _shedding, _count_shed = shedding, count_shed


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
    `parent`: the span context current in `context`, when the caller has looked it up already (as the
    executor does, `sdk_compat.sampled_parent`). `attributes` is copied, never kept nor changed: a
    caller may pass the same dict every time. `shed`: a sampled span that every span processor would
    drop now is not recorded (`shed_with`); not for spans the journal must see in flight."""
    sdk = sdk_compat.light_tracer(tracer)
    if sdk is None:
        first_record()
        return tracer.start_span(name, context=context, kind=kind, attributes=attributes, start_time=start_time)
    if parent is None:  # the context's span, read as `trace.get_current_span(context)` does, without its calls
        holder = sdk_compat.span_in(context) if context is not None else trace.get_current_span()
        parent = holder.get_span_context() if holder is not None else trace.INVALID_SPAN_CONTEXT
    trace_id, _, remote, flags, trace_state, valid = sdk_compat.span_context_fields(parent)
    if valid and flags & _SAMPLED and not remote and sdk_compat.samples_sampled_local_children(sdk.sampler):
        # The usual case, a sampled local parent and the default sampler: `decide`'s known answer, without the call
        flags = flags & _RANDOM | _SAMPLED
        span_attributes = dict(attributes)
    else:
        decision = decide(sdk, name, context, attributes, kind, (), parent)
        trace_id, flags, parent, trace_state, span_attributes, recording = decision
        if not recording:
            return non_recording(sdk, decision)
    if shed and flags & _SAMPLED:
        processors = sdk_compat.span_processors(sdk.span_processor) or ()
        reasons = _shedding(processors)
        if reasons is not None:
            _count_shed(processors, reasons)
            return non_recording(sdk, (trace_id, flags, parent, trace_state, span_attributes, True), shed=True)
    span_context = sdk_compat.new_span_context(trace_id, sdk.id_generator.generate_span_id(), flags, trace_state)
    return LightSpan(sdk, name, kind, span_context, parent, span_attributes, start_time or time_ns())


def finish(
    tracer: trace.Tracer,
    name: str,
    context: otel_context.Context | None,
    kind: SpanKind,
    start_time: int,
    end_time: int,
    attributes: dict[str, Any],
    status: Status | None,
) -> None:
    """A span of work already over: `start(tracer, name, context, {}, kind, start_time, shed=True)`, then
    `attributes` set (valid values, the caller's own, never used by it again: a `LightSpan` keeps the
    dict), `status` set (None: unset) and `end(end_time)`, in one go: a `LightSpan` is handed to the
    span processors as it is built."""
    span = start(tracer, name, context, {}, kind, start_time, shed=True)
    if type(span) is LightSpan:
        own = sdk_compat.own_attributes(span)
        if own:  # what the sampler added comes first, as `set_own_attributes` would leave it
            own.update(attributes)
            attributes = own
        sdk_compat.take_attributes(span, attributes)
        span.end_as_built(end_time, status)
        return
    span.set_attributes(attributes)
    if status is not None:
        span.set_status(status)
    span.end(end_time=end_time)
