"""The tracer provider stallwatch installs: the SDK's, whose tracers do not record spans nobody would export.

While every span processor would drop a span at its end (`export.guarded`: the backend is taken to
be down, or the queues are full), a sampled span that starts is not recorded: the tracer hands out
a non-recording `light_span.ShedSpan` with the ids and sampled flag the SDK would have given it,
and counts it as dropped. It is still current and its context propagates with the sampled flag;
every span that would be exported is recorded as without stallwatch.

A sampler cannot do this: DROP also clears the sampled flag, and downstream services with a
parent-based sampler would drop their spans too. The provider builds its tracers as the SDK does
(`get_tracer`'s arguments change between versions) and sets their class to `SheddingTracer`, a
check in front of the stock `start_span`. stallwatch's own tracer is left as it is: its journal
spans are always recorded, its hot-path spans shed through `core.light_span`. `exemplar_filter()`
is the SDK's `trace_based` filter minus shed spans, whose exemplar would link to a lost trace.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.trace import Link, SpanKind, TraceFlags
from opentelemetry.util import types

from .. import sdk_compat, telemetry
from ..core import light_span
from . import guarded

_sdk_start_span = sdk_trace.Tracer.start_span


class SheddingTracer(sdk_trace.Tracer):
    """The SDK's tracer; a sampled span that every span processor would drop is not recorded."""

    def start_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        processors = sdk_compat.span_processors(self.span_processor)
        reasons = guarded.shedding(processors)
        if reasons is not None and sdk_compat.plain_tracer(self):
            decision = light_span.decide(self, name, context, attributes, kind, links or (), None)
            if decision[1] & TraceFlags.SAMPLED:
                guarded.count_shed(processors, reasons)  # type: ignore[arg-type]
                return light_span.non_recording(self, decision, shed=True)
        return _sdk_start_span(
            self, name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
        )


class SheddingTracerProvider(sdk_trace.TracerProvider):
    """The SDK's tracer provider, whose tracers are `SheddingTracer`s (but for stallwatch's own)."""

    def get_tracer(self, instrumenting_module_name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        tracer = super().get_tracer(instrumenting_module_name, *args, **kwargs)
        if type(tracer) is sdk_trace.Tracer and instrumenting_module_name != telemetry.INSTRUMENTATION_SCOPE:
            sdk_compat.retype_tracer(tracer, SheddingTracer)
        return tracer


def exemplar_filter() -> Any | None:
    """The exemplar filter for stallwatch's meter provider: the SDK's `trace_based`, minus shed spans.

    None (the SDK decides, from OTEL_METRICS_EXEMPLAR_FILTER) when the variable names another filter,
    or on SDKs without exemplars (1.27)."""
    if os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based") != "trace_based":
        return None
    try:
        from opentelemetry.sdk.metrics import TraceBasedExemplarFilter
    except ImportError:
        return None

    class UnlessShed(TraceBasedExemplarFilter):
        """The SDK's trace-based exemplar filter, but for measurements made inside a shed span."""

        def should_sample(self, value: float, time_unix_nano: int, attributes: Any, context: Any) -> bool:
            span = trace.get_current_span(context)  # the SDK filter's test, plus the type of the span
            if span is trace.INVALID_SPAN or type(span) is light_span.ShedSpan:
                return False
            return bool(span.get_span_context().trace_flags.sampled)

    return UnlessShed()
