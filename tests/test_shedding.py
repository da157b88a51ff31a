"""Shedding (`export.shedding`, `export.guarded.shedding`): while every span processor would drop a
span, a sampled span that starts is not recorded, keeps its ids and sampled flag, and is counted.

Real SDK providers and processors, stallwatch's processors and exporter guard around the SDK's real
OTLP/HTTP exporter, and real misbehaving collectors on loopback (`scenarios/reliability_collectors.py`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

from conftest import SCENARIOS, clean_env, run_python
from stallwatch import telemetry
from stallwatch.core import light_span
from stallwatch.export.guarded import (
    BACKEND_DOWN,
    BACKOFF_FIRST,
    PROBE_ITEMS,
    QUEUE_FULL,
    CountingSpanProcessor,
    ExportGate,
    GuardedExporter,
    queued,
)
from stallwatch.export.shedding import SheddingTracer, SheddingTracerProvider, exemplar_filter
from support.fast_paths import FAST_PATHS, fast_paths_on  # noqa: F401  # a fixture
from support.waiting import wait_until

sys.path.insert(0, str(SCENARIOS))
from reliability_collectors import serve

# In this process, the shedding tracer and the light path, a fast path, against the SDK (the host
# started by `test_an_executor_item_and_a_child_under_a_shed_request` runs in the environment's mode).
pytestmark = [pytest.mark.matrix, pytest.mark.usefixtures("fast_paths_on")]
HAS_EXEMPLARS = exemplar_filter() is not None  # SDK 1.27 has no exemplars


class Pipeline:
    """A `SheddingTracerProvider` with one stallwatch processor exporting over OTLP/HTTP to `endpoint`."""

    def __init__(self, endpoint: str, sampler: sampling.Sampler | None = None) -> None:
        self.gate = ExportGate(lambda: None)
        exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=1)
        self.processor = CountingSpanProcessor(GuardedExporter(exporter, "traces", self.gate, SpanExportResult.FAILURE))
        self.provider = SheddingTracerProvider(sampler=sampler)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("host")

    def fail_an_export(self) -> None:
        """End one span and flush it to the dead collector: the backend is then taken to be down."""
        self.tracer.start_span("before the fault").end()
        self.provider.force_flush(5_000)
        assert self.processor.guard.breaker.down(), self.gate.dropped

    def dropped(self, reason: str) -> int:
        return self.gate.dropped.get(("traces", reason), 0)

    def close(self) -> None:
        self.gate.cut_off = True  # nothing left to send anywhere
        self.provider.shutdown()


@pytest.fixture
def refused() -> Iterator[Pipeline]:
    with serve("refuse", "http") as endpoint:
        pipeline = Pipeline(endpoint)
        yield pipeline
        pipeline.close()


def test_host_tracers_shed_while_the_backend_is_down_keeping_ids_and_the_sampled_flag(refused: Pipeline):
    tracer = refused.tracer
    assert type(tracer) is SheddingTracer
    with tracer.start_as_current_span("up") as span:
        assert span.is_recording()  # the backend is not known to be down yet
    refused.fail_an_export()
    before = refused.dropped(BACKEND_DOWN)

    with tracer.start_as_current_span("request") as request:
        assert not request.is_recording()
        assert trace.get_current_span() is request
        with tracer.start_as_current_span("db.query") as child:
            assert not child.is_recording()
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
    parent, own = request.get_span_context(), child.get_span_context()
    assert parent.is_valid and own.is_valid
    assert parent.trace_flags.sampled and own.trace_flags.sampled
    assert own.trace_id == parent.trace_id and own.span_id != parent.span_id
    # A child process or downstream service is told the trace is sampled, as without the fault.
    assert own.trace_flags == parent.trace_flags == span.get_span_context().trace_flags  # the flags of a recorded span
    assert carrier["traceparent"] == f"00-{own.trace_id:032x}-{own.span_id:016x}-{own.trace_flags:02x}"
    assert refused.dropped(BACKEND_DOWN) == before + 2


def test_after_the_back_off_only_the_probe_is_recorded_until_it_answers(refused: Pipeline):
    refused.fail_an_export()
    assert not refused.tracer.start_span("down").is_recording()
    wait_until(lambda: not refused.processor.guard.breaker.down(), "the back-off is over")
    # The back-off is over: the next export is a probe of PROBE_ITEMS items, so that many are recorded.
    for _ in range(PROBE_ITEMS):
        span = refused.tracer.start_span("probe")
        assert span.is_recording()
        span.end()
    assert queued(refused.processor) == PROBE_ITEMS
    # The rest would be cut from the probe: shed until it answers.
    before = refused.dropped(BACKEND_DOWN)
    assert not refused.tracer.start_span("after the probe's items").is_recording()
    assert refused.dropped(BACKEND_DOWN) == before + 1
    # The probe fails (nothing listens): a longer back-off, with room for the next probe.
    refused.provider.force_flush(5_000)
    assert refused.processor.guard.breaker.down() and refused.processor.guard.breaker.backoff == 2 * BACKOFF_FIRST


def test_unsampled_spans_are_not_counted_as_shed():
    with serve("refuse", "http") as endpoint:
        pipeline = Pipeline(endpoint, sampler=sampling.ParentBased(sampling.ALWAYS_OFF))
        try:
            pipeline.processor.guard.breaker.failed()  # as after a failed export (no sampled span to export here)
            shed_before = pipeline.dropped(BACKEND_DOWN)
            span = pipeline.tracer.start_span("not sampled")
            assert not span.is_recording() and not span.get_span_context().trace_flags.sampled
            assert pipeline.dropped(BACKEND_DOWN) == shed_before
        finally:
            pipeline.close()


def test_no_shedding_while_a_processor_of_the_host_would_keep_the_span(refused: Pipeline):
    kept = InMemorySpanExporter()
    refused.provider.add_span_processor(SimpleSpanProcessor(kept))
    refused.fail_an_export()
    with refused.tracer.start_as_current_span("request") as span:
        assert span.is_recording()
    assert [s.name for s in kept.get_finished_spans()][-1] == "request"


def test_stallwatch_own_tracer_is_never_shed_its_journaled_spans_are_recorded(refused: Pipeline):
    own = refused.provider.get_tracer(telemetry.INSTRUMENTATION_SCOPE)
    assert type(own) is not SheddingTracer
    refused.fail_an_export()
    assert own.start_span("ssh.tunnel.open").is_recording()
    # Hot-path spans shed only when asked to (executor items, child processes); Nebius calls do not.
    kept = light_span.start(own, "nebius call", None, {})
    assert isinstance(kept, light_span.LightSpan)
    before = refused.dropped(BACKEND_DOWN)
    shed = light_span.start(own, "pool work item", None, {}, shed=True)
    assert not shed.is_recording() and shed.get_span_context().trace_flags & TraceFlags.SAMPLED
    assert refused.dropped(BACKEND_DOWN) == before + 1


def test_spans_shed_while_the_queue_is_full_of_a_collector_that_never_answers(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    with serve("silent", "http") as endpoint:
        pipeline = Pipeline(endpoint)
        try:
            for _ in range(4):  # a full batch: the worker takes it and waits on the collector
                pipeline.tracer.start_span("in flight").end()
            wait_until(lambda: pipeline.processor.guard.in_flight, "the worker exports the batch")
            assert pipeline.processor.guard.in_flight == 4
            for _ in range(4):
                pipeline.tracer.start_span("queued").end()
            assert pipeline.dropped(QUEUE_FULL) == 0
            span = pipeline.tracer.start_span("shed")
            assert not span.is_recording() and span.get_span_context().trace_flags.sampled
            assert pipeline.dropped(QUEUE_FULL) == 1
        finally:
            pipeline.close()


@pytest.mark.parametrize("shed", [True, False])
def test_an_executor_item_and_a_child_under_a_shed_request(tmp_path: Path, shed: bool):
    """End to end through `setup()`: the host's request, its executor item and its child process are
    shed, the item still runs in the request's trace, and every shed span is counted. With
    STALLWATCH_SHED_SPANS=false (or the fast paths off, where nothing is shed) they are recorded, then
    dropped at their end: the same counts."""
    code = f"""
import json, subprocess
import stallwatch
from concurrent.futures import ThreadPoolExecutor
from opentelemetry import trace
session = stallwatch.setup(file_dir={str(tmp_path)!r})
tracer = trace.get_tracer("host")
tracer.start_span("before").end()
trace.get_tracer_provider().force_flush(5000)
processor = session._pipeline._processors[0]
assert processor.guard.breaker.down(), session._pipeline._gate.dropped

def item():
    span = trace.get_current_span()
    return span.get_span_context(), span.is_recording()

pool = ThreadPoolExecutor(1)
with tracer.start_as_current_span("request") as request:
    request_recording = request.is_recording()
    seen, item_recording = pool.submit(item).result()
    subprocess.run(["/bin/true"], check=True)
dropped = dict(session._pipeline._gate.dropped)
config = getattr(session._pipeline.meter_provider, "_sdk_config", None)
print(json.dumps({{
    "exemplar_filter": type(getattr(config, "exemplar_filter", None)).__name__,
    "request_recording": request_recording, "item_recording": item_recording,
    "request_trace": request.get_span_context().trace_id,
    "item_trace": seen.trace_id, "item_span": seen.span_id, "request_span": request.get_span_context().span_id,
    "item_sampled": seen.trace_flags.sampled,
    "backend_down": dropped.get(("traces", "backend_down"), 0),
}}))
"""
    with serve("refuse", "http") as endpoint:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "STALLWATCH_WATCHDOG": "false",
            "STALLWATCH_SHED_SPANS": str(shed).lower(),
        }
        result = run_python(code, env=clean_env(**env))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["request_recording"] is report["item_recording"] is not (shed and FAST_PATHS)
    assert report["item_trace"] == report["request_trace"] and report["item_sampled"]
    assert report["item_span"] != report["request_span"]  # the item had its own span
    assert report["backend_down"] == 3  # the request, its item and its child: shed, or dropped at their end
    if HAS_EXEMPLARS:
        assert report["exemplar_filter"] == "UnlessShed"  # see test_no_exemplar_links_to_a_shed_span


def test_a_provider_without_processors_records_as_the_sdk_does():
    tracer = SheddingTracerProvider().get_tracer("host")
    assert type(tracer) is SheddingTracer
    assert tracer.start_span("no processor").is_recording()  # nothing would drop it: the SDK's span


@pytest.mark.skipif(not HAS_EXEMPLARS, reason="this SDK (1.27) has no exemplars")
def test_no_exemplar_links_to_a_shed_span(refused: Pipeline):
    """Measurements inside a shed span offer no exemplar (it would link to a span the backend never
    gets); inside a recorded span, or a sampled remote parent, they do, as with the SDK's filter."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.trace import NonRecordingSpan, SpanContext

    reader = InMemoryMetricReader()
    orders = MeterProvider(metric_readers=[reader], exemplar_filter=exemplar_filter()).get_meter("host")
    counter = orders.create_counter("host.orders")
    with refused.tracer.start_as_current_span("recorded") as recorded:
        counter.add(1, {"case": "recorded"})
    refused.fail_an_export()
    with refused.tracer.start_as_current_span("shed") as shed:
        assert type(shed) is light_span.ShedSpan and shed.get_span_context().trace_flags.sampled
        counter.add(1, {"case": "shed"})
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with trace.use_span(NonRecordingSpan(remote)):
        counter.add(1, {"case": "remote"})

    points = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    exemplars = {point.attributes["case"]: [e.span_id for e in point.exemplars] for point in points}
    assert exemplars == {"recorded": [recorded.get_span_context().span_id], "shed": [], "remote": [0x5678]}


def test_the_processor_passes_on_and_drops_what_the_sdks_own_does():
    """`CountingSpanProcessor.on_end` with the backend up (its SDK 1.34+ shortcut to the batch
    processor included) against the SDK's `BatchSpanProcessor`: a sampled span reaches the
    exporter, an unsampled one does not, and a `ReadableSpan` given no context is dropped quietly
    or raises, as the SDK's does (it raises up to SDK 1.33)."""

    def run(processor: BatchSpanProcessor, exporter: InMemorySpanExporter) -> tuple[list[Any], list[str]]:
        outcomes: list[Any] = []
        for name, context in contexts.items():
            try:
                processor.on_end(ReadableSpan(name=name, context=context))
                outcomes.append(None)
            except Exception as exc:  # compared with what the SDK's processor raises
                outcomes.append(type(exc))
        assert processor.force_flush(5_000)
        processor.shutdown()
        return outcomes, [span.name for span in exporter.get_finished_spans()]

    contexts = {
        "sampled": SpanContext(1, 2, False, TraceFlags(TraceFlags.SAMPLED)),
        "unsampled": SpanContext(1, 3, False, TraceFlags(TraceFlags.DEFAULT)),
        "no context": None,
    }
    ours, theirs = InMemorySpanExporter(), InMemorySpanExporter()
    gate = ExportGate(lambda: None)
    counted = run(CountingSpanProcessor(GuardedExporter(ours, "traces", gate, SpanExportResult.FAILURE)), ours)
    assert counted == run(BatchSpanProcessor(theirs), theirs)
    assert counted[1] == ["sampled"]
