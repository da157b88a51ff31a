"""The export thread (`export.batching`): the three signals share one thread, and an export waiting on a
collector that never answers holds up neither the host, nor the heartbeat, nor for long the other signals.

Real SDK providers, stallwatch's processors around the SDK's real OTLP/HTTP exporter, a real collector
on loopback that accepts and never answers (`scenarios/reliability_collectors.py`).
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs import export as log_export
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from conftest import SCENARIOS
from stallwatch.core import background
from stallwatch.export.guarded import CountingLogProcessor, CountingSpanProcessor, ExportGate, GuardedExporter
from support.waiting import wait_until

sys.path.insert(0, str(SCENARIOS))
from reliability_collectors import serve

pytestmark = pytest.mark.matrix

SPARE = "stallwatch-export-spare"


def _threads() -> list[str]:
    return [thread.name for thread in threading.enumerate()]


def test_log_records_are_exported_on_a_spare_thread_while_a_span_export_waits_on_a_silent_collector(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")  # four spans: a batch, exported at once
    monkeypatch.setenv("OTEL_BLRP_SCHEDULE_DELAY", "100")
    in_memory = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter  # SDK < 1.39
    exported_logs = in_memory()
    gate = ExportGate(lambda: None)
    background.ensure()  # the heartbeat's thread, which starts the spare (setup() starts it)
    with serve("silent", "http") as endpoint:
        span_exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=20)
        spans = CountingSpanProcessor(GuardedExporter(span_exporter, "traces", gate, SpanExportResult.FAILURE))
        tracer_provider = TracerProvider(shutdown_on_exit=False)
        tracer_provider.add_span_processor(spans)
        logs = CountingLogProcessor(GuardedExporter(exported_logs, "logs", gate, log_export.LogExportResult.FAILURE))
        logger_provider = LoggerProvider(shutdown_on_exit=False)
        logger_provider.add_log_record_processor(logs)
        logger = logging.getLogger("stallwatch-test-export-thread")
        with warnings.catch_warnings():  # SDK 1.45 deprecates its handler for another package's
            warnings.simplefilter("ignore", DeprecationWarning)
            logger.addHandler(LoggingHandler(logger_provider=logger_provider))
        logger.propagate = False
        try:
            tracer = tracer_provider.get_tracer("host")
            for _ in range(4):
                tracer.start_span("waits on the collector").end()
            wait_until(lambda: spans.guard.in_flight, "the export thread sends the spans")
            logger.warning("exported meanwhile")

            wait_until(lambda: exported_logs.get_finished_logs() or not spans.guard.in_flight, "the record is exported")
            assert spans.guard.in_flight == 4  # the span export still waits: the record went by another thread
            assert SPARE in _threads()
        finally:
            logger.handlers.clear()
            gate.cut_off = True
        # The collector is gone: the span export fails, the spare finds nothing to run and leaves.
    wait_until(lambda: not spans.guard.in_flight, "the span export ends")
    wait_until(lambda: SPARE not in _threads(), "the spare thread leaves")
    tracer_provider.shutdown()
    logger_provider.shutdown()
