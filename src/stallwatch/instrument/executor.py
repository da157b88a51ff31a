"""Executor instrumentation: every `concurrent.futures.ThreadPoolExecutor`, including an event
loop's default executor (`run_in_executor`, `asyncio.to_thread`).

incidents/002_… is a worker that died between `work_queue.get()` and `_WorkItem.run()`: the item
it had dequeued was referenced by nothing, its future stayed pending, and the awaiting request hung
with every counter healthy. No wrapper of `_WorkItem.run` can see that item, so stallwatch counts
the queue itself: each executor's `SimpleQueue` is replaced at construction by a subclass whose
`put` (called by `submit`) logs the item; `get` stays the C method, so a worker's dequeue runs no
Python code of ours. Items the queue has handed out (puts minus `qsize()`, FIFO) are "in flight";
`detect.wedge` finds the ones whose worker died. The module-level `_worker` is wrapped to see a
worker die the moment it happens, and `_WorkItem.run` to time each item, carry the submitter's
OpenTelemetry context into the worker and scope interruptions to the item (see `interrupt`).

CPython internals used (3.10 to 3.14, checked): `ThreadPoolExecutor._work_queue`, `_threads`,
`_thread_name_prefix`, `_max_workers`, `_shutdown`, `_broken`, `_shutdown_lock`,
`_adjust_thread_count`, module `_worker`, `_shutdown`, `_global_shutdown_lock`, `_WorkItem.future`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import thread as cf_thread
from dataclasses import dataclass, field
from typing import Any

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, Status, StatusCode

from .. import interrupt, telemetry
from .. import timeout as execution_timeouts
from . import light_span
from ._common import FAULTS, Deferred, instrument, meter
from .scrub import MAX_NAME_CHARS, clip_text, scrub_text

SETTING = "STALLWATCH_INSTRUMENT_EXECUTOR"
_log = logging.getLogger("stallwatch")
_QUEUE_LOCK = threading.Lock()  # guards every accounting queue's put log; held only for a few lines


class WorkerDied(RuntimeError):
    """Raised into a future whose executor worker died before finishing it (STALLWATCH_EXECUTOR_HEAL).

    Attributes: `thread_name` of the dead worker and `cause`, the exception that killed it.
    """

    def __init__(self, thread_name: str, cause: BaseException | None, dequeued_only: bool) -> None:
        what = "dequeued this item and died before running it" if dequeued_only else "died while running this item"
        reason = f" ({type(cause).__name__}: {scrub_text(cause)})" if cause is not None else ""
        super().__init__(f"executor worker {scrub_text(thread_name, MAX_NAME_CHARS)} {what}{reason}")
        self.thread_name = thread_name
        self.cause = cause


@dataclass(eq=False, slots=True)
class ItemRecord:
    """What stallwatch knows about one submitted work item."""

    executor: ExecutorState
    future: Future[Any]
    submitted: float
    context: otel_context.Context
    span: Span | None = None
    dequeued_seen: float | None = None  # when the wedge check first saw it handed out
    started: float | None = None
    thread: threading.Thread | None = None
    finished: bool = False
    orphaned: bool = False
    interrupt: Any = None  # the pending scoped interruption, see `interrupt`


@dataclass(eq=False)
class ExecutorState:
    """Per-executor accounting, reachable as `executor._stallwatch`."""

    name: str
    executor_ref: weakref.ReferenceType[ThreadPoolExecutor]
    in_flight: list[ItemRecord] = field(default_factory=list)
    deaths: list[tuple[threading.Thread, BaseException | None]] = field(default_factory=list)
    attributes: dict[str, str] = field(default_factory=dict)  # the metric attributes, built once
    span_name: str = ""

    def __post_init__(self) -> None:
        self.attributes = {telemetry.EXECUTOR_NAME.name: self.name}
        self.span_name = f"{self.name} work item"


class _AccountingQueue(queue.SimpleQueue):  # type: ignore[type-arg]
    """The executor's work queue, logging what is put so that what was taken can be known."""

    state: ExecutorState
    puts: int
    handed_out: int
    log: deque[ItemRecord | None]

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        record = _record_submission(self.state, item)
        with _QUEUE_LOCK:
            super().put(item, block, timeout)
            self.puts += 1
            log = self.log
            # A started item was certainly dequeued (FIFO: so was all before it). Account for it
            # now, so the log holds only what may still wait and no finished item stays alive
            # until the next wedge check (measured: that retention cost 5-13 us/item in GC).
            while log and log[0] is not None and log[0].started is not None:
                log.popleft()
                self.handed_out += 1
            log.append(record)

    def put_nowait(self, item: Any) -> None:
        self.put(item, block=False)

    def oldest_pending_submitted(self) -> float | None:
        """Monotonic submission time of the oldest item no worker has dequeued yet, or None."""
        with _QUEUE_LOCK:
            waiting_from = self.puts - self.qsize() - self.handed_out  # log index of the first waiting item
            for index in range(max(waiting_from, 0), len(self.log)):
                record = self.log[index]
                if record is not None:
                    return record.submitted
        return None

    def take_handed_out(self) -> list[ItemRecord]:
        """Records of items a worker has dequeued since the last call (FIFO accounting)."""
        taken: list[ItemRecord] = []
        with _QUEUE_LOCK:
            handed_out = self.puts - self.qsize()
            while self.handed_out < handed_out and self.log:
                record = self.log.popleft()
                self.handed_out += 1
                if record is not None:
                    taken.append(record)
        return taken


EXECUTORS: weakref.WeakSet[ThreadPoolExecutor] = weakref.WeakSet()
_current_item = interrupt.RUNNING  # worker thread ident -> the item it runs (kept by `interrupt`)
_death_causes: dict[int, BaseException] = {}
_instruments: dict[str, Any] = {}
_histograms: list[Deferred] = []  # queue and run durations, in that order
_original_run = cf_thread._WorkItem.run
_tracer: trace.Tracer | None = None


def executor_name(executor: ThreadPoolExecutor) -> str:
    """`stallwatch.executor.name`: the pool's thread-name prefix (any object the pool `%s`-formats into its
    thread names, made valid UTF-8 of at most `MAX_NAME_CHARS`), `asyncio-default` for asyncio's."""
    prefix = getattr(executor, "_thread_name_prefix", "")
    if prefix == "asyncio":
        return "asyncio-default"
    name = clip_text(prefix if isinstance(prefix, str) else scrub_text(prefix) if prefix else "")
    return name or "ThreadPoolExecutor"


def state_of(executor: ThreadPoolExecutor) -> ExecutorState | None:
    return getattr(executor, "_stallwatch", None)


def current_item(ident: int) -> ItemRecord | None:
    """The item a worker thread is running now, or None (idle, or not an instrumented worker)."""
    return _current_item.get(ident)


def _add(metric: telemetry.Metric, value: float, attributes: dict[str, str]) -> None:
    counter = _instruments.get(metric.name)
    if counter is not None:
        counter.add(value, attributes)


def drain_histograms() -> None:
    """Hand the queue/run durations waiting since the last drain to the SDK histograms.

    Called every wedge check (0.5 s) and before each metric collection: a work item only appends
    its two durations to a deque (well under 1 µs), instead of two SDK `record()` calls (4-10 µs).
    """
    for deferred in _histograms:
        deferred.drain()


# ---- wrappers -----------------------------------------------------------------------------------


def _init_wrapper(wrapped: Any, executor: ThreadPoolExecutor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    wrapped(*args, **kwargs)
    try:
        state = ExecutorState(executor_name(executor), weakref.ref(executor))
        accounting = _AccountingQueue()
        accounting.state, accounting.puts, accounting.handed_out, accounting.log = state, 0, 0, deque()
        executor._work_queue = accounting  # type: ignore[attr-defined]  # no worker holds the old one yet
        executor._stallwatch = state  # type: ignore[attr-defined]
        EXECUTORS.add(executor)
    except Exception:
        FAULTS.record("executor", SETTING)


def _record_submission(state: ExecutorState, item: Any) -> ItemRecord | None:
    """Runs in the submitting thread, inside `submit`: stamp the item (None: a shutdown sentinel)."""
    if item is None:
        return None
    try:
        context = otel_context.get_current()
        record = ItemRecord(state, item.future, time.monotonic(), context)
        if context and _tracer is not None:  # an empty context (no span, no baggage) is falsy
            parent = trace.get_current_span(context).get_span_context()
            if parent.is_valid and parent.trace_flags.sampled:
                record.span = light_span.start(_tracer, state.span_name, context, dict(state.attributes), parent=parent)
        item._stallwatch = record
        execution_timeouts.guarded_submission(record)
        return record
    except Exception:
        FAULTS.record("executor", SETTING)
        return None


def _run(item: Any, *args: Any) -> Any:
    """Stands in for `_WorkItem.run`: a plain function rather than a wrapt wrapper, which costs
    0.45 µs per call on a bound method (measured), a quarter of the 2 µs budget per item."""
    record: ItemRecord | None = getattr(item, "_stallwatch", None)
    if record is None:
        return _original_run(item, *args)
    if record.orphaned:
        return None  # already failed with WorkerDied: running it now would kill this worker too
    token = _start(record)
    try:
        return _original_run(item, *args)
    except BaseException as exc:
        if not interrupt.item_raised(record, exc):  # ours landed outside the item's try: worker lives
            raise
        return None
    finally:
        interrupt.item_finished(record)
        _finish(record, token)


def _start(record: ItemRecord) -> object:
    record.started = time.monotonic()
    record.thread = threading.current_thread()
    interrupt.item_started(record)  # from here the item is `current_item()` of this thread
    try:
        span = record.span
        if span is None:
            if not record.context:
                return None  # the submitter had no OpenTelemetry context: nothing to carry over
            return otel_context.attach(record.context)
        return otel_context.attach(trace.set_span_in_context(span, record.context))
    except Exception:
        FAULTS.record("executor", SETTING)
        return None


def _finish(record: ItemRecord, token: object) -> None:
    """After `interrupt.item_finished`: the item is no longer this thread's current item."""
    try:
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]
        record.finished = True
        if execution_timeouts.OVERDUE:
            execution_timeouts.item_finished(record)
        submitted = record.submitted
        started = record.started or submitted
        run_seconds = time.monotonic() - started
        attributes = record.executor.attributes
        if _histograms:
            _histograms[0].record(started - submitted, attributes)
            _histograms[1].record(run_seconds, attributes)
        span = record.span
        if span is not None:
            durations = {
                "stallwatch.executor.queue_seconds": started - submitted,
                "stallwatch.executor.run_seconds": run_seconds,
            }
            if isinstance(span, light_span.LightSpan):
                span.set_own_attributes(durations)
            else:
                span.set_attributes(durations)
            span.end()
    except Exception:
        FAULTS.record("executor", SETTING)


def _worker_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    interrupt.worker_started()
    try:
        return wrapped(*args, **kwargs)
    finally:
        interrupt.worker_stopped()
        _after_worker_exit(args[0] if args else None)


def _after_worker_exit(executor_reference: Any) -> None:
    """`_worker` returned: a normal exit at shutdown, or a death it logged and swallowed."""
    try:
        ident = threading.get_ident()
        cause = _death_causes.pop(ident, None)
        executor = executor_reference() if executor_reference is not None else None
        shutting_down = executor is None or executor._shutdown or cf_thread._shutdown or executor._broken
        if cause is None and shutting_down:
            _current_item.pop(ident, None)
            return
        state = state_of(executor) if executor is not None else None
        if state is None:
            return
        thread = threading.current_thread()
        state.deaths.append((thread, cause))
        _add(
            telemetry.EXECUTOR_WORKER_DEATHS,
            1,
            {**state.attributes, telemetry.ERROR_TYPE.name: type(cause).__name__ if cause else "unknown"},
        )
        from ..detect import wedge

        wedge.worker_died(state, thread, cause, _current_item.pop(ident, None))
    except Exception:
        FAULTS.record("executor", SETTING)


class _DeathCause(logging.Filter):
    """Keeps the exception `_worker` logs as 'Exception in worker' before its thread ends."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Exception in worker" and record.exc_info and record.exc_info[1] is not None:
            _death_causes[threading.get_ident()] = record.exc_info[1]
        return True


_DEATH_FILTER = _DeathCause()


# ---- observable gauges ---------------------------------------------------------------------------


def _observe_workers(options: CallbackOptions) -> Iterable[Observation]:
    for executor in list(EXECUTORS):
        state = state_of(executor)
        if state is not None:
            alive = sum(1 for t in list(executor._threads) if t.is_alive())  # type: ignore[attr-defined]
            yield Observation(alive, state.attributes)


def _observe_pending(options: CallbackOptions) -> Iterable[Observation]:
    drain_histograms()  # before the SDK reads the histograms of this collection
    for executor in list(EXECUTORS):
        state = state_of(executor)
        if state is not None:
            yield Observation(executor._work_queue.qsize(), state.attributes)  # type: ignore[attr-defined]


def _observe_oldest_pending(options: CallbackOptions) -> Iterable[Observation]:
    now = time.monotonic()
    for executor in list(EXECUTORS):
        state = state_of(executor)
        work_queue = getattr(executor, "_work_queue", None)
        if state is not None and isinstance(work_queue, _AccountingQueue):
            submitted = work_queue.oldest_pending_submitted()
            yield Observation(0.0 if submitted is None else now - submitted, state.attributes)


def _observe_running(options: CallbackOptions) -> Iterable[Observation]:
    running: dict[str, int] = {}
    for record in list(_current_item.values()):
        if record.thread is not None and record.thread.is_alive():
            running[record.executor.name] = running.get(record.executor.name, 0) + 1
    for executor in list(EXECUTORS):
        state = state_of(executor)
        if state is not None:
            yield Observation(running.get(state.name, 0), state.attributes)


def _observe_max_workers(options: CallbackOptions) -> Iterable[Observation]:
    for executor in list(EXECUTORS):
        state = state_of(executor)
        if state is not None:
            yield Observation(executor._max_workers, state.attributes)  # type: ignore[attr-defined]


class ExecutorInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Instruments every ThreadPoolExecutor built after `instrument()` (and the death hook for all).

    Keyword arguments of `instrument()`: `meter_provider`, `tracer_provider` (default: the global
    ones) and `settings` (a `stallwatch.Settings`; default: read from the environment), which set
    the raw `SetAsyncExc` guard and the wedge detector (interval, stall threshold, heal).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        global _tracer, _original_run
        from ..config import ConfigError, Settings
        from ..detect import wedge

        try:
            settings = kwargs.get("settings") or Settings.load()
        except ConfigError as exc:
            _log.error("stallwatch: %s; executor instrumentation stays off.", exc)
            return
        meter_ = meter(kwargs.get("meter_provider"))
        FAULTS.bind(meter_)
        _tracer = trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, tracer_provider=kwargs.get("tracer_provider"))
        _histograms[:] = [
            Deferred(meter_, telemetry.EXECUTOR_QUEUE_DURATION),
            Deferred(meter_, telemetry.EXECUTOR_RUN_DURATION),
        ]
        for metric in (
            telemetry.EXECUTOR_WORKER_DEATHS,
            telemetry.EXECUTOR_ORPHANED,
            telemetry.EXECUTOR_HEALED,
            telemetry.WEDGE_DETECTED,
        ):
            _instruments[metric.name] = instrument(meter_, metric)
        instrument(meter_, telemetry.EXECUTOR_PENDING, _observe_pending)
        instrument(meter_, telemetry.EXECUTOR_RUNNING, _observe_running)
        instrument(meter_, telemetry.EXECUTOR_OLDEST_PENDING, _observe_oldest_pending)
        instrument(meter_, telemetry.EXECUTOR_WORKERS, _observe_workers)
        instrument(meter_, telemetry.EXECUTOR_MAX_WORKERS, _observe_max_workers)
        interrupt.install(meter_, guard_raw_calls=settings.guard_async_exc)
        execution_timeouts.install(meter_)
        wedge.configure(
            wedge.WedgeSettings(settings.wedge_check_interval, settings.queue_stall_seconds, settings.executor_heal)
        )
        wedge.ensure_running()
        wrapt.wrap_function_wrapper(ThreadPoolExecutor, "__init__", _init_wrapper)
        _original_run = cf_thread._WorkItem.run
        cf_thread._WorkItem.run = _run  # type: ignore[method-assign]
        wrapt.wrap_function_wrapper(cf_thread, "_worker", _worker_wrapper)
        logging.getLogger("concurrent.futures").addFilter(_DEATH_FILTER)

    def _uninstrument(self, **kwargs: Any) -> None:
        global _tracer
        unwrap(ThreadPoolExecutor, "__init__")
        if cf_thread._WorkItem.run is _run:
            cf_thread._WorkItem.run = _original_run  # type: ignore[method-assign]
        unwrap(cf_thread, "_worker")
        logging.getLogger("concurrent.futures").removeFilter(_DEATH_FILTER)
        interrupt.uninstall()
        execution_timeouts.uninstall()
        drain_histograms()
        _histograms.clear()
        _instruments.clear()
        _tracer = None


def end_span_orphaned(record: ItemRecord, reason: str) -> None:
    """Close an orphaned item's span with an error (its worker will never close it)."""
    if record.span is not None:  # the detector already added the "stallwatch.wedge" event
        record.span.set_status(Status(StatusCode.ERROR, reason))
        record.span.end()
