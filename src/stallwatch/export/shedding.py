"""The tracer provider stallwatch installs: the SDK's, whose tracers do not record spans nobody would export.

While every span processor would drop a span at its end (the backend is taken to be down, or the
queues are full: `export.guarded`), a sampled span that starts is not recorded: the tracer hands
out a non-recording span with the ids and sampled flag the SDK would have given it, and counts it
as dropped. Nothing else changes: the span is still current, its context still propagates (with
the sampled flag, so downstream services and child processes decide as they would have), and
every span that would be exported is recorded as without stallwatch.

The SDK offers no way to do this: a sampler that says DROP also clears the sampled flag, which
would make every downstream service with a parent-based sampler drop its spans too, for a fault
of our backend. So the provider's tracers override `start_span`. The SDK builds its tracers in
`get_tracer` with arguments that change between versions (1.27-1.45), so the provider builds
them as the SDK does and then sets their class to `SheddingTracer`, which only adds a check in
front of the stock `start_span`. stallwatch's own tracer is left as it is: the spans it must
keep in flight for the journal (Nebius calls, SSH tunnels) are always recorded, and its hot-path
spans shed through `core.light_span`.

A shed span is a `light_span.ShedSpan`. With the SDK's default exemplar filter (`trace_based`:
a measurement made inside a sampled span may become an exemplar linking to it), the meter
provider gets `exemplar_filter()`: the same filter, minus measurements made inside a shed span,
whose exemplar would link to a trace the backend never got (and whose offering costs about 2 µs
per measurement, measured in a warm loop on SDK 1.45).
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

from .. import telemetry
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
        processors = getattr(self.span_processor, "_span_processors", None)
        reasons = guarded.shedding(processors)
        if reasons is not None and self._as_sdk():
            decision = light_span.decide(self, name, context, attributes, kind, links or (), None)
            if decision[1] & TraceFlags.SAMPLED:
                guarded.count_shed(processors, reasons)  # type: ignore[arg-type]
                return light_span.non_recording(self, decision, shed=True)
        return _sdk_start_span(
            self, name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
        )

    def _as_sdk(self) -> bool:
        """Whether a span this tracer does not record is exactly what the SDK would hand out: the
        tracer is enabled (SDK 1.45+ tracer configurator) and records no self-metrics (SDK 1.45+)."""
        is_enabled = getattr(self, "_is_enabled", None)
        if is_enabled is not None and not is_enabled():
            return False
        metrics = getattr(self, "_tracer_metrics", None)
        return metrics is None or type(metrics).__name__ == "NoOpTracerMetrics"


class SheddingTracerProvider(sdk_trace.TracerProvider):
    """The SDK's tracer provider, whose tracers are `SheddingTracer`s (but for stallwatch's own)."""

    def get_tracer(self, instrumenting_module_name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        tracer = super().get_tracer(instrumenting_module_name, *args, **kwargs)
        if type(tracer) is sdk_trace.Tracer and instrumenting_module_name != telemetry.INSTRUMENTATION_SCOPE:
            tracer.__class__ = SheddingTracer
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
