"""Exporters and batch processors that count every item that never reaches the backend.

The stock SDK already keeps a dead or slow backend off the host's threads: `span.end()` and
`logger.info()` only append to a bounded deque (2048 items by default, `OTEL_BSP_MAX_QUEUE_SIZE` /
`OTEL_BLRP_MAX_QUEUE_SIZE`) and a daemon worker exports from it. Measured with a collector that
accepts and never answers (tests/test_reliability.py), those calls stay in the microseconds, so we
keep the stock queues, sizes and workers. What the SDK does not do is say what it lost: a full
queue drops silently after one log line, a failed export only logs. So we count, as
`stallwatch.telemetry.dropped` {signal, reason}:

- `queue_full`: the processor subclasses look at the queue before handing an item to the SDK
  (a full deque drops its oldest item on append). The SDK keeps the queue in a different place
  in 1.27-1.33 and 1.34+, so `_queue()` finds it; the deque's `maxlen` is the limit.
- `export_failed`: `GuardedExporter` counts the items of every batch the exporter returns FAILURE
  for (or raises on); a metric export that fails counts 1 (the next cumulative export carries it).
- `shutdown_timeout`: what was queued or in flight when the shutdown budget ran out
  (`leftovers()`, counted and logged by the pipeline).

The exporters also give the pipeline two hooks: `ExportGate.cut_off`, set when the shutdown budget
runs out, makes every later export fail at once without touching the network (a shutdown thread
left behind must not keep a socket busy for the exporter's 10 s timeout per batch), and the first
export in a new process (a fork child that lives on) calls back into the pipeline, from the
exporter's worker thread and never from a fork handler, so the child gets its own shutdown thread.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .. import telemetry

_log = logging.getLogger("stallwatch.export")

QUEUE_FULL, EXPORT_FAILED, SHUTDOWN_TIMEOUT = telemetry.DROP_REASON.values


class ExportGate:
    """What every guarded exporter and processor of one pipeline shares."""

    def __init__(self, on_new_process: Callable[[], object]) -> None:
        self.cut_off = False
        self._counter: Any = None
        self._pid = os.getpid()
        self._on_new_process = on_new_process

    def bind(self, counter: Any) -> None:
        """Count into `counter` (stallwatch.telemetry.dropped) from now on."""
        self._counter = counter

    def drop(self, signal: str, reason: str, count: int) -> None:
        counter = self._counter
        if count <= 0 or counter is None:
            return
        try:
            counter.add(count, {telemetry.TELEMETRY_SIGNAL.name: signal, telemetry.DROP_REASON.name: reason})
        except Exception:  # counting must never break an export worker
            _log.debug("stallwatch: cannot count dropped telemetry", exc_info=True)

    def entering_export(self) -> None:
        pid = os.getpid()
        if pid != self._pid:  # racing workers may both call back: the callback tolerates that
            self._pid = pid
            self._on_new_process()


def _failed(result: Any) -> bool:
    # SpanExportResult, LogExportResult / LogRecordExportResult (1.39+), MetricExportResult.
    return getattr(result, "name", None) == "FAILURE"


class GuardedExporter:
    """Wraps a span or log exporter: counts failed batches, fails fast once cut off."""

    def __init__(self, inner: Any, signal: str, gate: ExportGate, failure: Any) -> None:
        self.inner = inner
        self.signal = signal
        self.gate = gate
        self.in_flight = 0
        self._failure = failure

    def export(self, batch: Sequence[Any]) -> Any:
        if self.gate.cut_off:
            return self._failure  # already counted as shutdown_timeout leftovers
        self.gate.entering_export()
        self.in_flight = len(batch)
        try:
            result = self.inner.export(batch)
        except Exception:
            self._count_failure(len(batch))
            raise  # the SDK's worker logs it, as without stallwatch
        finally:
            self.in_flight = 0
        if _failed(result):
            self._count_failure(len(batch))
        return result

    def _count_failure(self, count: int) -> None:
        if not self.gate.cut_off:
            self.gate.drop(self.signal, EXPORT_FAILED, count)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.inner.shutdown()


class GuardedMetricExporter(MetricExporter):
    """Wraps a metric exporter: counts failed exports, fails fast once cut off."""

    def __init__(self, inner: MetricExporter, gate: ExportGate) -> None:
        super().__init__()
        # The reader asks its exporter for these; they must be the wrapped exporter's own.
        self._preferred_temporality = inner._preferred_temporality
        self._preferred_aggregation = inner._preferred_aggregation
        self.inner = inner
        self.gate = gate
        self.closed = False

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if self.gate.cut_off:
            return MetricExportResult.FAILURE
        self.gate.entering_export()
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            self._count_failure()
            raise
        if _failed(result):
            self._count_failure()
        return result

    def _count_failure(self) -> None:
        if not self.gate.cut_off:
            self.gate.drop("metrics", EXPORT_FAILED, 1)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        # The reader calls this after its final export: from here on nothing of it is pending.
        self.closed = True
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def _queue(processor: Any) -> deque[Any]:
    """The batch processor's bounded deque: 1.34+ `_batch_processor._queue`, 1.27-1.33 `queue` / `_queue`."""
    holder = getattr(processor, "_batch_processor", processor)
    queue = getattr(holder, "_queue", None)
    return queue if queue is not None else holder.queue


def queued(processor: Any) -> int:
    return len(_queue(processor))


def _full(processor: Any) -> bool:
    queue = _queue(processor)
    return queue.maxlen is not None and len(queue) >= queue.maxlen


class CountingSpanProcessor(BatchSpanProcessor):
    """The stock BatchSpanProcessor (fork-aware via `forksafe.otel_compat`), counting queue-full drops."""

    def __init__(self, exporter: GuardedExporter) -> None:
        super().__init__(exporter)  # queue size, batch size and delay from OTEL_BSP_* as in the SDK
        self.guard = exporter

    def on_end(self, span: Any) -> None:
        dropping = bool(span.context and span.context.trace_flags.sampled) and _full(self)
        super().on_end(span)
        if dropping:
            self.guard.gate.drop("traces", QUEUE_FULL, 1)


class CountingLogProcessor(BatchLogRecordProcessor):
    """The stock BatchLogRecordProcessor, counting queue-full drops (`emit`, or `on_emit` since 1.39)."""

    def __init__(self, exporter: GuardedExporter) -> None:
        super().__init__(exporter)  # OTEL_BLRP_* as in the SDK
        self.guard = exporter


def _counting_emit(name: str) -> Callable[..., None]:
    stock = getattr(BatchLogRecordProcessor, name)

    def emit(self: CountingLogProcessor, record: Any) -> None:
        dropping = _full(self)
        stock(self, record)
        if dropping:
            self.guard.gate.drop("logs", QUEUE_FULL, 1)

    emit.__name__ = emit.__qualname__ = name
    return emit


_EMIT = "on_emit" if "on_emit" in vars(BatchLogRecordProcessor) else "emit"
setattr(CountingLogProcessor, _EMIT, _counting_emit(_EMIT))


def leftovers(
    processors: Sequence[CountingSpanProcessor | CountingLogProcessor],
    metric_exporters: Sequence[GuardedMetricExporter],
) -> dict[str, int]:
    """What is still queued or in flight, by signal: spans and log records, and metric exports not done."""
    counts = {"traces": 0, "metrics": 0, "logs": 0}
    for processor in processors:
        counts[processor.guard.signal] += queued(processor) + processor.guard.in_flight
    for exporter in metric_exporters:
        counts["metrics"] += 0 if exporter.closed else 1
    return counts
