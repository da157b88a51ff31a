"""The export thread (`export.batching`): the three signals share one thread, and an export waiting on a
collector that never answers holds up neither the host, nor the heartbeat, nor for long the other signals.

Real SDK providers, stallwatch's processors around the SDK's real OTLP/HTTP exporter, a real collector
on loopback that accepts and never answers (`scenarios/reliability_collectors.py`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs import export as log_export
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from conftest import SCENARIOS
from stallwatch.config import Batching
from stallwatch.core import background
from stallwatch.export.batching import EXPORTS, BatchLane
from stallwatch.export.guarded import CountingLogProcessor, CountingSpanProcessor, ExportGate, GuardedExporter
from support.waiting import wait_until

sys.path.insert(0, str(SCENARIOS))
from reliability_collectors import serve

pytestmark = pytest.mark.matrix

SPARE = "stallwatch-export-spare"


def _threads() -> list[str]:
    return [thread.name for thread in threading.enumerate()]


def _spares() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == SPARE]


def test_log_records_are_exported_on_a_spare_thread_while_a_span_export_waits_on_a_silent_collector(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")  # four spans: a batch, exported at once
    monkeypatch.setenv("OTEL_BLRP_SCHEDULE_DELAY", "500")  # a spare looks more often: idle in between
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
            (spare,) = _spares()
            logger.warning("exported later")
            wait_until(lambda: len(exported_logs.get_finished_logs()) > 1 or not spans.guard.in_flight,
                       "the second record is exported")  # fmt: skip
            assert spans.guard.in_flight == 4
            assert _spares() == [spare]  # the same spare: it stays while the other thread is held
        finally:
            logger.handlers.clear()
            gate.cut_off = True
        # The collector is gone: the span export fails, the spare finds nothing to run and leaves.
    wait_until(lambda: not spans.guard.in_flight, "the span export ends")
    wait_until(lambda: SPARE not in _threads(), "the spare thread leaves")
    tracer_provider.shutdown()
    logger_provider.shutdown()


class _HeldExporter:
    """An exporter whose every export waits until released: a collector that answers only when told."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def export(self, batch: list[object]) -> None:
        self.entered.set()
        self.released.wait(60)

    def shutdown(self) -> None:
        self.released.set()


class _CountedLane(BatchLane):
    """The real lane, counting how often an export thread looks at it."""

    looked = 0

    def ready(self) -> bool:
        self.looked += 1
        return super().ready()


def test_an_export_thread_sleeps_while_the_lane_that_is_due_is_held_by_another_export_thread():
    held_first, held_second = _HeldExporter(), _HeldExporter()
    first = _CountedLane("traces", held_first, Batching(queue=8, batch=8, delay_seconds=0.05))
    second = BatchLane("logs", held_second, Batching(queue=8, batch=8, delay_seconds=0.05))
    background.ensure()
    EXPORTS.add(first)
    EXPORTS.add(second)
    try:
        first.add("span")
        assert held_first.entered.wait(30), "an export thread exports the span"
        second.add("record")  # the other thread is held: a spare takes the record, and is held in turn
        assert held_second.entered.wait(30), "a spare exports the record"
        held_first.released.set()  # the first thread is free; the lane that is due is the spare's
        wait_until(lambda: not first.turn.locked(), "the first export ends")
        looked = first.looked
        time.sleep(1.0)  # what is measured is how often the free thread looks meanwhile, not a deadline

        assert first.looked - looked < 100  # once per delay or so; a thread that does not sleep looks all the time
    finally:
        held_first.released.set()
        held_second.released.set()
        first.shutdown()
        second.shutdown()


def test_a_log_record_after_the_shutdown_is_dropped_without_a_warning_per_record(caplog: pytest.LogCaptureFixture):
    in_memory = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter
    gate = ExportGate(lambda: None)
    logs = CountingLogProcessor(GuardedExporter(in_memory(), "logs", gate, log_export.LogExportResult.FAILURE))
    logger_provider = LoggerProvider(shutdown_on_exit=False)
    logger_provider.add_log_record_processor(logs)
    with warnings.catch_warnings():  # SDK 1.45 deprecates its handler for another package's
        warnings.simplefilter("ignore", DeprecationWarning)
        handler = LoggingHandler(logger_provider=logger_provider)
    logs.shutdown()
    # A function name, as logging's own records have: SDK 1.27 warns on a None attribute.
    record = logging.LogRecord("host", logging.INFO, __file__, 1, "after the shutdown", None, None, func="emit")

    with caplog.at_level(logging.WARNING, logger="opentelemetry"):
        handler.emit(record)

    assert [entry.getMessage() for entry in caplog.records if entry.name.startswith("opentelemetry")] == []
