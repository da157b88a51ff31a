"""Exporters and batch processors that count every item that never reaches the backend.

They queue in bounded queues that `export.batching` exports off the host's threads, and count what
is lost, by reason, in integers an observable counter reads:

- `queue_full`: on a full queue the item being added is dropped and counted (as the Java and Go
  SDKs do), never the oldest one silently.
- `export_failed`: the items of a batch the exporter fails or raises on; a metric export counts 1.
- `backend_down`, `backend_slow`: after a failed export, or one slower than `STALLWATCH_SLOW_EXPORT_SECONDS`
  but for building its exporter (`export.budget`), a back-off (1 s, doubled per failed probe up to 30 s,
  reset by a success) drops items before they are queued or encoded; then at most `PROBE_ITEMS` items
  are queued until a probe of them answers (half-open). The SDK's retries within one export stay.
- `shutdown_timeout`: what was queued or in flight when the shutdown budget ran out (`leftovers()`).

`shedding()` says which processors would drop a span about to start; `ExportGate` is what they share.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricExportResult
from opentelemetry.sdk.trace import SpanProcessor

from .. import config, sdk_compat, telemetry
from ..core import histograms, light_span
from ..core.faults import dropped_values
from ..forksafe import guard
from . import exit_check
from .batching import EXPORTS, BatchLane
from .budget import Budget

if TYPE_CHECKING:
    from opentelemetry.sdk._logs.export import LogRecordExporter

DROP_REASONS = telemetry.DROP_REASON.values
QUEUE_FULL, EXPORT_FAILED, BACKEND_DOWN, SHUTDOWN_TIMEOUT, BACKEND_SLOW = DROP_REASONS
_EVERY_DROP = [(signal, reason) for signal in telemetry.TELEMETRY_SIGNAL.values for reason in DROP_REASONS]
BACKOFF_FIRST = 1.0  # seconds the backend is taken to be down after a failed export
BACKOFF_MAX = 30.0  # the back-off doubles after each failed probe, up to this
PROBE_ITEMS = 16  # the first export after a back-off sends at most this many items


class ExportGate:
    """What every guarded exporter and processor of one pipeline shares.

    `cut_off`, set when the shutdown budget runs out, makes every later export fail at once without
    touching the network: a shutdown thread left behind must not keep a socket busy for the
    exporter's timeout per batch. The first export in a new process (a fork child that lives on)
    calls `on_new_process`, from the exporter's worker thread and never from a fork handler, so the
    child gets its own shutdown thread; never in a child about to exec (a `preexec_fn` that flushes),
    which has no shutdown and starts no thread."""

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
        """Callback of the `stallwatch.telemetry.dropped` observable counter. Metric values that
        instrumentations dropped before aggregation (`Deferred`) count as {metrics, queue_full}."""
        counts = dict.fromkeys(_EVERY_DROP, 0) | self.dropped  # at 0 before the first: then it is an increase
        values = dropped_values()
        if values:
            counts["metrics", QUEUE_FULL] = counts.get(("metrics", QUEUE_FULL), 0) + values
        return [
            Observation(count, {telemetry.TELEMETRY_SIGNAL.name: signal, telemetry.DROP_REASON.name: reason})
            for (signal, reason), count in counts.items()
        ]

    def entering_export(self) -> None:
        pid = os.getpid()
        if pid != self._pid and not guard.STATE.child_exec_bound:  # racing workers may both call back: it copes
            self._pid = pid
            self._on_new_process()


def _failed(result: Any) -> bool:
    # SpanExportResult, LogExportResult / LogRecordExportResult (1.39+), MetricExportResult.
    return getattr(result, "name", None) == "FAILURE"


class Breaker:
    """Whether the backend is taken to be down (or overloaded), from the outcome of the last exports."""

    def __init__(self) -> None:
        # Monotonic end of the back-off; 0.0 while the backend is up (one compare on the hot path).
        # It stays set after the back-off, until an export succeeds: the probe has not answered yet.
        self.down_until = 0.0
        self.backoff = 0.0  # > 0 after a failed export: the next export is a probe
        self.probe_room = 0  # items that may still be queued for the probe once the back-off is over
        self.reason = BACKEND_DOWN  # what items dropped during the back-off are counted as

    def down(self) -> bool:
        """Within the back-off: exports are not attempted."""
        until = self.down_until
        return until != 0.0 and until > time.monotonic()

    def admits(self, take: bool) -> bool:
        """Whether an item may be queued now: the backend is up, or the back-off is over and the probe
        has room (`take`: the item is being queued and takes its place). The count is not atomic
        across threads, so it is approximate: it only bounds work that would be wasted."""
        until = self.down_until
        if until == 0.0:
            return True
        if until > time.monotonic() or self.probe_room <= 0:
            return False
        if take:
            self.probe_room -= 1
        return True

    def failed(self, reason: str = BACKEND_DOWN) -> None:
        """An export failed (`backend_down`), or succeeded too slowly (`backend_slow`): back off."""
        self.reason = reason
        self.backoff = min(max(self.backoff * 2, BACKOFF_FIRST), BACKOFF_MAX)
        self.down_until = time.monotonic() + self.backoff
        self.probe_room = PROBE_ITEMS

    def succeeded(self) -> None:
        self.backoff = 0.0
        self.down_until = 0.0


class GuardedExporter:
    """Wraps a span or log exporter: counts failed batches, backs off from a failing backend and
    from one whose exports succeed only after `slow_seconds` (0: never), fails fast once cut off.

    `final` (set by the pipeline's shutdown: no later export would carry what it holds) makes every
    later export, and `attempt_next` (set by a flush) the next one, go to the backend during a back-off
    too, whole, not cut to a probe; the shutdown's budget and `cut_off` bound them."""

    def __init__(self, inner: Any, signal: str, gate: ExportGate, failure: Any, slow_seconds: float = 0.0) -> None:
        self.inner = inner
        self.slow_seconds = slow_seconds
        self.signal = signal
        self.gate = gate
        self.in_flight = 0
        self.breaker = Breaker()
        self.final = False
        self.attempt_next = False
        self._failure = failure

    def export(self, batch: Sequence[Any]) -> Any:
        if self.gate.cut_off:
            return self._failure  # already counted as shutdown_timeout leftovers
        attempt, self.attempt_next = self.final or self.attempt_next, False
        if self.breaker.down() and not attempt:
            self.gate.drop(self.signal, self.breaker.reason, len(batch))
            return self._failure
        self.gate.entering_export()
        if self.breaker.backoff and len(batch) > PROBE_ITEMS and not attempt:
            self.gate.drop(self.signal, self.breaker.reason, len(batch) - PROBE_ITEMS)
            batch = batch[:PROBE_ITEMS]
        batch = exit_check.checked(self.signal, batch)  # what stallwatch recorded from the host, checked once more
        self.in_flight = len(batch)
        allowed = Budget(self.slow_seconds)
        try:
            result = self.inner.export(batch)
        except Exception:
            self.in_flight = 0
            self._count_failure(len(batch))
            raise  # the SDK's worker logs it, as without stallwatch
        # Not on a BaseException: the shutdown's deadline stopping an export on the exiting thread
        # leaves the batch in flight, for the count of what the backend never took.
        self.in_flight = 0
        if _failed(result):
            self._count_failure(len(batch))
        elif self.slow_seconds > 0 and allowed.left() < 0:
            self.breaker.failed(BACKEND_SLOW)  # delivered: nothing of this batch is counted as lost
        else:
            self.breaker.succeeded()
        return result

    def _count_failure(self, count: int) -> None:
        self.breaker.failed(BACKEND_DOWN)
        if not self.gate.cut_off:
            self.gate.drop(self.signal, EXPORT_FAILED, count)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.inner.shutdown()


class GuardedMetricExporter(MetricExporter):
    """Wraps a metric exporter: counts failed exports, fails fast once cut off.

    Once `final` is set (the pipeline's shutdown, before its reader's last collection), an export
    that would only repeat the last one delivered (every point the same but for its timestamp, or a
    zero delta) is not sent: a flush at a server's stop followed by the process's shutdown exports
    each worker's metrics once, and more than once only when something changed in between. Any
    other is sent, during a back-off too: no later export would carry what it holds. So is the next
    export once `attempt_next` is set (a flush's collection).
    """

    def __init__(self, inner: MetricExporter, gate: ExportGate) -> None:
        # The reader asks its exporter for these; they must be the wrapped exporter's own.
        temporality, aggregation = sdk_compat.exporter_preferences(inner)
        super().__init__(preferred_temporality=temporality, preferred_aggregation=aggregation)
        self.inner = inner
        self.gate = gate
        self.breaker = Breaker()
        self.closed = False
        self.final = False
        self.attempt_next = False
        self._delivered: Any = None  # the last metrics data the backend took

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if self.gate.cut_off:
            return MetricExportResult.FAILURE
        # Cumulative sums: the next export after the back-off carries it all; the last collection has none.
        attempt, self.attempt_next = self.final or self.attempt_next, False
        if self.breaker.down() and not attempt:
            self.gate.drop("metrics", BACKEND_DOWN, 1)
            return MetricExportResult.FAILURE
        self.gate.entering_export()
        metrics_data = histograms.inject(metrics_data)
        if self.final and None not in (metrics_data, self._delivered) and _repeats(metrics_data, self._delivered):
            return MetricExportResult.SUCCESS
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            self._count_failure()
            raise
        if _failed(result):
            self._count_failure()
        else:
            self.breaker.succeeded()
            self._delivered = metrics_data
        return result

    def _count_failure(self) -> None:
        self.breaker.failed()
        if not self.gate.cut_off:
            self.gate.drop("metrics", EXPORT_FAILED, 1)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        # The reader calls this after its final export: from here on nothing of it is pending.
        self.closed = True
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def _repeats(metrics_data: Any, delivered: Any) -> bool:
    """Whether `metrics_data` says nothing `delivered` did not: each of its points is a zero delta or
    equal to the point of the same metric and attributes in `delivered`, but for its timestamp."""
    said = _points(delivered)
    for key, temporality, point in _walk(metrics_data):
        if not dataclasses.is_dataclass(point):
            return False
        if temporality == AggregationTemporality.DELTA and not (
            getattr(point, "value", 0) or getattr(point, "count", 0)
        ):
            continue
        if said.get(key) != _content(point):
            return False
    return True


def _points(metrics_data: Any) -> dict[tuple[str, str, str, str], Any]:
    return {key: _content(point) for key, _, point in _walk(metrics_data) if dataclasses.is_dataclass(point)}


def _walk(metrics_data: Any) -> Iterable[tuple[tuple[str, str, str, str], Any, Any]]:
    """Every data point of `metrics_data`, keyed by resource, scope, metric name and attributes, with its
    metric's temporality (None for a gauge)."""
    for resource_metrics in metrics_data.resource_metrics:
        resource = repr(sorted(resource_metrics.resource.attributes.items()))
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                temporality = getattr(metric.data, "aggregation_temporality", None)
                for point in metric.data.data_points:
                    attributes = repr(sorted((point.attributes or {}).items()))
                    yield (resource, scope_metrics.scope.name, metric.name, attributes), temporality, point


def _content(point: Any) -> list[Any]:
    return [getattr(point, f.name) for f in dataclasses.fields(point) if f.name != "time_unix_nano"]


def queued(processor: CountingSpanProcessor | CountingLogProcessor) -> int:
    return len(processor.lane.queue)


def _full(processor: CountingSpanProcessor | CountingLogProcessor) -> bool:
    """True when adding an item would push one out, in the process the queue belongs to.

    In a fork child the inherited queue may be full: the item must then reach the lane, whose pid
    check empties the queue and restarts the export thread there.
    """
    lane = processor.lane
    return len(lane.queue) >= processor._limit and lane.pid == os.getpid()


def _early_drop(processor: CountingSpanProcessor | CountingLogProcessor, take: bool = True) -> str | None:
    """Why an item must be dropped before it is queued (`backend_down`, `backend_slow`, `queue_full`), or None.

    `take`: the item is being queued now (not only started or built), see `Breaker.admits`."""
    breaker = processor.guard.breaker
    if not breaker.admits(take):
        return breaker.reason
    return QUEUE_FULL if _full(processor) else None


class CountingSpanProcessor(SpanProcessor):
    """A batch span processor on the shared export thread (`export.batching`), counting what it drops.

    As the SDK's BatchSpanProcessor: sampled spans are queued (`OTEL_BSP_*`) and exported in batches.
    """

    def __init__(self, exporter: GuardedExporter, shed: bool = True) -> None:
        self.lane = BatchLane("traces", exporter, config.sdk_batching("OTEL_BSP"))
        self.guard = exporter
        self.sheds = shed  # STALLWATCH_SHED_SPANS: whether `shedding()` may count on this processor dropping
        if shed:
            _light_spans_ask_shed()
        # One deque for the processor's life (a fork child clears it): the usual case, backend up and
        # room in the queue, is told from two reads, before any call.
        self._bounded = self.lane.queue
        self._limit = self._bounded.maxlen or sys.maxsize
        self.closed = False
        EXPORTS.add(self.lane)

    def on_end(self, span: Any) -> None:
        if not sdk_compat.span_sampled(span):
            return
        if self.closed or self.guard.breaker.down_until or len(self._bounded) >= self._limit:
            if self.closed:  # a span after shutdown is not exported
                return
            reason = _early_drop(self)
            if reason is not None:
                self.guard.gate.drop("traces", reason, 1)
                return
        self.lane.add(span)

    # `on_start` stays the stock no-op: the light span path needs every processor's to be one.

    def shutdown(self) -> None:
        self.closed = True
        self.lane.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.lane.flush()


class _Enqueue:
    """The exporter a `SimpleLogRecordProcessor` hands each record to (built for export by the SDK's
    own code, per version): it queues the record on the lane."""

    def __init__(self, lane: BatchLane) -> None:
        self.lane = lane

    def export(self, batch: Sequence[Any]) -> None:
        for record in batch:
            self.lane.add(record)

    def shutdown(self) -> None:
        self.lane.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.lane.flush()


class CountingLogProcessor(SimpleLogRecordProcessor):
    """A batch log record processor on the shared export thread (`export.batching`), counting what it
    drops. As the SDK's BatchLogRecordProcessor: records are queued (`OTEL_BLRP_*`) and exported in
    batches; the stock simple processor turns each into what the exporter takes, then queues it."""

    def __init__(self, exporter: GuardedExporter) -> None:
        self.lane = BatchLane("logs", exporter, config.sdk_batching("OTEL_BLRP"))
        super().__init__(cast("LogRecordExporter", _Enqueue(self.lane)))
        self.guard = exporter
        self._bounded = self.lane.queue  # as in CountingSpanProcessor
        self._limit = self._bounded.maxlen or sys.maxsize
        self.closed = False
        EXPORTS.add(self.lane)

    def shutdown(self) -> None:
        self.closed = True
        super().shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.lane.flush()


def _counting_emit(name: str) -> Callable[..., None]:
    stock = getattr(SimpleLogRecordProcessor, name)

    def emit(self: CountingLogProcessor, record: Any) -> None:
        if self.closed or self.guard.breaker.down_until or len(self._bounded) >= self._limit:
            if self.closed:  # a record after shutdown: the stock simple processor logs a WARNING for each one
                return
            reason = _early_drop(self)
            if reason is not None:
                self.guard.gate.drop("logs", reason, 1)
                return
        stock(self, record)

    emit.__name__ = emit.__qualname__ = name
    return emit


def shedding(processors: Sequence[Any] | None) -> list[str] | None:
    """Why every span processor in `processors` would drop a sampled span now, or None: what the
    provider's tracers (`export.shedding`) and stallwatch's light spans (`light_span.shed_with`) ask.

    None when there is no processor, or one that is not stallwatch's (it may keep the span). Costs
    two reads per processor, and no call, while the backend is up and the queues have room."""
    if not processors:
        return None
    for processor in processors:
        if (
            type(processor) is not CountingSpanProcessor
            or not (processor.guard.breaker.down_until or len(processor._bounded) >= processor._limit)
            or not processor.sheds
        ):
            return None
    reasons = [_early_drop(processor, take=False) for processor in processors]
    return None if None in reasons else reasons  # type: ignore[return-value]


def count_shed(processors: Sequence[CountingSpanProcessor], reasons: Sequence[str]) -> None:
    """Count a span shed for `reasons` (what `shedding` returned) as dropped by each processor."""
    for processor, reason in zip(processors, reasons, strict=True):
        processor.guard.gate.drop("traces", reason, 1)


def _light_spans_ask_shed() -> None:
    """Light spans started with `shed=True` ask `shedding()` before they are built, and are counted
    by `count_shed()` when shed (`light_span.shed_with`)."""
    light_span.shed_with(shedding, count_shed)


def drop_early(processors: Sequence[CountingLogProcessor]) -> bool:
    """True, and counted, when every log processor would drop a record: then it need not be built."""
    if not processors:
        return False
    reasons = [_early_drop(processor, take=False) for processor in processors]
    if None in reasons:
        return False
    for processor, reason in zip(processors, reasons, strict=True):
        processor.guard.gate.drop("logs", reason, 1)  # type: ignore[arg-type]
    return True


_EMIT = "on_emit" if "on_emit" in vars(SimpleLogRecordProcessor) else "emit"
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
