"""Exporters and batch processors that count every item that never reaches the backend.

The stock SDK already keeps a dead or slow backend off the host's threads: `span.end()` and
`logger.info()` only append to a bounded deque (2048 items by default, `OTEL_BSP_MAX_QUEUE_SIZE` /
`OTEL_BLRP_MAX_QUEUE_SIZE`) and a daemon worker exports from it. Measured with a collector that
accepts and never answers (tests/test_reliability.py), those calls stay in the microseconds, so we
keep the stock queues, sizes and workers. What the SDK does not do is say what it lost, and its
drop path is not free: on a full queue, SDK 1.34+ logs a warning for every item (deduplicated
afterwards by a filter: 3.7 µs per call here) before it drops the *oldest* item. So:

- `queue_full`: the processor subclasses check the queue first and, when it is full, drop the
  item being added (what the Java and Go SDKs do), count it and return; the SDK's drop path never
  runs. The SDK keeps the queue in a different place in 1.27-1.33 and 1.34+ (`_queue()`).
- `export_failed`: `GuardedExporter` counts the items of every batch the exporter returns FAILURE
  for (or raises on); a metric export that fails counts 1 (the next cumulative export carries it).
- `shutdown_timeout`: what was queued or in flight when the shutdown budget ran out
  (`leftovers()`, counted and logged by the pipeline).

Counts are plain integers read by an observable counter at collection time: a synchronous
`counter.add()` costs 5 µs per call on SDK 1.45 here, paid on the host's thread for every
dropped span while a backend is down. On the wire both are the same cumulative monotonic sum.

The exporters also give the pipeline two hooks: `ExportGate.cut_off`, set when the shutdown budget
runs out, makes every later export fail at once without touching the network (a shutdown thread
left behind must not keep a socket busy for the exporter's 10 s timeout per batch), and the first
export in a new process (a fork child that lives on) calls back into the pipeline, from the
exporter's worker thread and never from a fork handler, so the child gets its own shutdown thread.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .. import telemetry

QUEUE_FULL, EXPORT_FAILED, SHUTDOWN_TIMEOUT = telemetry.DROP_REASON.values


class ExportGate:
    """What every guarded exporter and processor of one pipeline shares."""

    def __init__(self, on_new_process: Callable[[], object]) -> None:
        self.cut_off = False
        self.dropped: dict[tuple[str, str], int] = {}
        self._pid = os.getpid()
        self._on_new_process = on_new_process

    def drop(self, signal: str, reason: str, count: int) -> None:
        # No call between the read and the write: atomic under the GIL, from any thread.
        try:
            self.dropped[signal, reason] += count
        except KeyError:
            self.dropped[signal, reason] = count

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        """Callback of the `stallwatch.telemetry.dropped` observable counter."""
        return [
            Observation(count, {telemetry.TELEMETRY_SIGNAL.name: signal, telemetry.DROP_REASON.name: reason})
            for (signal, reason), count in list(self.dropped.items())
        ]

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


def _holder(processor: Any) -> Any:
    """What holds the queue: the shared `_batch_processor` since SDK 1.34, the processor itself before."""
    return getattr(processor, "_batch_processor", processor)


def _queue(processor: Any) -> deque[Any]:
    """The bounded deque: `_queue` (1.34+, and logs before), `queue` (spans up to 1.33)."""
    holder = _holder(processor)
    queue = getattr(holder, "_queue", None)
    return queue if queue is not None else holder.queue


def queued(processor: Any) -> int:
    return len(_queue(processor))


def _full(processor: Any) -> bool:
    """True when adding an item would push one out, in the process the queue belongs to.

    In a fork child whose at-fork handlers never ran, the inherited queue may be full: the SDK's
    own path must then run, since its pid check is what restarts the worker there.
    """
    queue = _queue(processor)
    return len(queue) >= (queue.maxlen or len(queue) + 1) and _holder(processor)._pid == os.getpid()


class CountingSpanProcessor(BatchSpanProcessor):
    """The stock BatchSpanProcessor (fork-aware via `forksafe.otel_compat`), counting queue-full drops."""

    def __init__(self, exporter: GuardedExporter) -> None:
        super().__init__(exporter)  # queue size, batch size and delay from OTEL_BSP_* as in the SDK
        self.guard = exporter

    def on_end(self, span: Any) -> None:
        if _full(self) and span.context and span.context.trace_flags.sampled:
            self.guard.gate.drop("traces", QUEUE_FULL, 1)
            return
        super().on_end(span)


class CountingLogProcessor(BatchLogRecordProcessor):
    """The stock BatchLogRecordProcessor, counting queue-full drops (`emit`, or `on_emit` since 1.39)."""

    def __init__(self, exporter: GuardedExporter) -> None:
        super().__init__(exporter)  # OTEL_BLRP_* as in the SDK
        self.guard = exporter


def _counting_emit(name: str) -> Callable[..., None]:
    stock = getattr(BatchLogRecordProcessor, name)

    def emit(self: CountingLogProcessor, record: Any) -> None:
        if _full(self):
            self.guard.gate.drop("logs", QUEUE_FULL, 1)
            return
        stock(self, record)

    emit.__name__ = emit.__qualname__ = name
    return emit


def drop_if_full(processors: Sequence[CountingLogProcessor]) -> bool:
    """True, and counted, when every log processor would drop a record: then it need not be built."""
    if not processors or not all(_full(processor) for processor in processors):
        return False
    for processor in processors:
        processor.guard.gate.drop("logs", QUEUE_FULL, 1)
    return True


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
