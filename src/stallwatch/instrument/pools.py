"""Executor instrumentation: every `concurrent.futures.ThreadPoolExecutor`, including an event
loop's default executor (`run_in_executor`, `asyncio.to_thread`).

A worker that dies between `work_queue.get()` and running the item leaves that item referenced by
nothing (incident 002 in docs/incidents.md), so the queue itself is accounted: each executor's
`SimpleQueue` is replaced at construction by `_AccountingQueue`, whose `put` (called by `submit`)
logs the item; `get` stays the C method, so a worker's dequeue runs no Python code of ours. Items
the queue has handed out (the log's head, all but its last `qsize()`, FIFO) are in flight; the
module-level `_worker` is wrapped to see a worker die the moment it happens, and whoever registered
with `on_worker_death` (the wedge detector) is told. `_WorkItem` is replaced by `worker.WorkItem`,
so no wrapper layer runs per item.

CPython internals used (3.10 to 3.13): `ThreadPoolExecutor._work_queue`, `_threads`,
`_thread_name_prefix`, `_max_workers`, `_shutdown`, `_broken`, `_shutdown_lock`, module `_worker`,
`_shutdown`, `_WorkItem`. `INSTALLATION` switches it (`setup()`, and `executor.ExecutorInstrumentor`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import thread as cf_thread
from typing import Any

import wrapt
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import interrupt, sdk_compat, telemetry
from .. import timeout as execution_timeouts
from ..core import light_span
from ..core.faults import FAULTS, Deferred, instrument
from ..core.scrub import clip_text, scrub_text
from ._lifecycle import Installation, start_meter, start_settings, unwrap
from .work_item import DURATIONS, DURATIONS_LIMIT, SETTING, ExecutorState, ItemRecord, _OriginalWorkItem
from .worker import WorkItem, _context_var, use_context

_READ_LOCK_TIMEOUT = 1.0  # s; an executor's lock held longer (e.g. left held in a fork child) skips a check


class _AccountingQueue(queue.SimpleQueue):
    """The executor's work queue, logging what is put so that what was taken can be known.

    The log needs no lock of its own: `submit`, the only caller putting work items, holds the
    executor's `_shutdown_lock` (CPython 3.10 to 3.13 alike), and the readers here take it too. Shutdown
    sentinels (None) are also put without it (`_worker`, `_python_exit`, the weakref callback): they
    are appended after the put and never prune, so a reader racing with one sees at most one item
    too few as handed out, which the next check corrects.
    """

    state: ExecutorState
    log: deque[ItemRecord | None]  # what was put and may not have been dequeued yet, in order
    lock: Any  # the executor's `_shutdown_lock`

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if type(item) is not WorkItem:  # a shutdown sentinel, or an item of an older instrumentation
            _simple_put(self, item, block, timeout)
            self.log.append(None)
            return
        # Stamp the item in the submitting thread, inside `submit`.
        record = None
        try:
            state = self.state
            item.executor, item.submitted = state, _monotonic_ns()
            context = _context_var.get()
            if context:  # an empty context (no span, no baggage) is falsy: nothing to carry over
                item.context = context
                # The item's span, when the submitter is inside a sampled trace
                if _tracer is not None and (parent := sdk_compat.sampled_parent(context)) is not None:
                    # (kind, start time, parent, shed) given by position: keywords measured slower on this hot path
                    item.span = light_span.start(
                        _tracer, state.span_name, context, state.attributes, _INTERNAL, None, parent, True
                    )
            scope = _timeout_scope.get()
            if scope is not None:  # an execution_timeout guards this work
                scope.items.append(item)
            record = item
        except Exception:
            item.executor = None  # run it as if stallwatch were not there
            FAULTS.record("executor", SETTING)
        _simple_put(self, item, block, timeout)
        log = self.log
        # A started item was certainly dequeued (FIFO: so was all before it). Account for it now,
        # so the log holds only what may still wait and no finished item stays alive (and costs
        # the garbage collector) until the next wedge check.
        while log and (head := log[0]) is not None and head.started is not None:
            log.popleft()
        log.append(record)

    def put_nowait(self, item: Any) -> None:
        self.put(item, block=False)

    def oldest_pending_submitted(self) -> float | None:
        """Monotonic submission time of the oldest item no worker has dequeued yet, or None."""
        if not self.lock.acquire(timeout=_READ_LOCK_TIMEOUT):
            return None  # held that long by a submitter: try again next time
        try:
            # The queue holds the last qsize() items put (FIFO), the log's tail; the rest were handed out.
            for index in range(max(len(self.log) - self.qsize(), 0), len(self.log)):
                record = self.log[index]
                if record is not None:
                    return record.submitted / 1e9
        finally:
            self.lock.release()
        return None

    def take_handed_out(self) -> list[ItemRecord]:
        """Records of items a worker has dequeued since the last call (FIFO accounting)."""
        taken: list[ItemRecord] = []
        if not self.lock.acquire(timeout=_READ_LOCK_TIMEOUT):
            return taken  # held that long by a submitter: try again next time
        try:
            for _ in range(len(self.log) - self.qsize()):
                record = self.log.popleft()
                if record is not None:
                    taken.append(record)
        finally:
            self.lock.release()
        return taken


EXECUTORS: weakref.WeakSet[ThreadPoolExecutor] = weakref.WeakSet()
_current_item = interrupt.RUNNING  # worker thread ident -> the item it runs (kept by `interrupt`)
_death_causes: dict[int, BaseException] = {}
_instruments: dict[str, Any] = {}
_zeroed: set[str] = set()  # executor names whose series this instrumentation has made at zero
_monotonic_ns = time.monotonic_ns
_simple_put = queue.SimpleQueue.put
_INTERNAL = SpanKind.INTERNAL
_timeout_scope = execution_timeouts.SCOPE
_tracer: trace.Tracer | None = None
WorkerDeath = Callable[[ExecutorState, threading.Thread, "BaseException | None", "ItemRecord | None"], None]
_on_worker_death: WorkerDeath | None = None


def on_worker_death(callback: WorkerDeath | None) -> None:
    """Call `callback(state, thread, cause, held)` in each worker of an accounted pool that dies
    (`cause`: what killed it, if known; `held`: the item it was running, if any). One callback: the
    wedge detector sets it as it is installed (None: nobody is told)."""
    global _on_worker_death
    _on_worker_death = callback


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


def _add(metric: telemetry.Metric, value: float, attributes: dict[str, str]) -> None:
    counter = _instruments.get(metric.name)
    if counter is not None:
        counter.add(value, attributes)


def _zero_series(state: ExecutorState) -> None:
    """A pool's counters and histograms at zero, once per executor name: Prometheus sees no increase
    in a series born with its first event, so a first wedge would read as nothing."""
    if state.name in _zeroed or not _instruments:
        return
    _zeroed.add(state.name)
    for metric in (telemetry.EXECUTOR_ORPHANED, telemetry.EXECUTOR_HEALED):
        _add(metric, 0, state.attributes)
    for kind in telemetry.WEDGE_KIND.values:
        _add(telemetry.WEDGE_DETECTED, 0, {**state.attributes, telemetry.WEDGE_KIND.name: kind})
    interrupt.zero(state.attributes)
    for deferred in DURATIONS:
        deferred.zero(state.attributes)


def drain_histograms() -> None:
    """Hand the queue/run durations waiting since the last drain to the SDK histograms.

    Called every wedge check and before each metric collection: a work item only appends its two
    durations to two lists (`ExecutorState.durations`), instead of two SDK `record()` calls.
    """
    for deferred in DURATIONS:
        deferred.drain()


# ---- wrappers -----------------------------------------------------------------------------------


# ---- wrappers -----------------------------------------------------------------------------------


def _init_wrapper(wrapped: Any, executor: ThreadPoolExecutor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    wrapped(*args, **kwargs)
    try:
        state = ExecutorState(executor_name(executor), weakref.ref(executor))
        accounting = _AccountingQueue()
        accounting.state, accounting.log, accounting.lock = state, deque(), executor._shutdown_lock
        executor._work_queue = accounting  # no worker holds the old one yet
        executor._stallwatch = state  # type: ignore[attr-defined]
        EXECUTORS.add(executor)
        _zero_series(state)
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
        held = _current_item.pop(ident, None)
        if _on_worker_death is not None:
            _on_worker_death(state, thread, cause, held)
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
            alive = sum(1 for t in list(executor._threads) if t.is_alive())
            yield Observation(alive, state.attributes)


def _observe_pending(options: CallbackOptions) -> Iterable[Observation]:
    drain_histograms()  # before the SDK reads the histograms of this collection
    for executor in list(EXECUTORS):
        state = state_of(executor)
        if state is not None:
            yield Observation(executor._work_queue.qsize(), state.attributes)


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
        state = record.executor  # never None: only accounted items become current
        if state is not None and record.thread is not None and record.thread.is_alive():
            running[state.name] = running.get(state.name, 0) + 1
    for executor in list(EXECUTORS):
        state = state_of(executor)
        if state is not None:
            yield Observation(running.get(state.name, 0), state.attributes)


def _observe_orphaned(options: CallbackOptions) -> Iterable[Observation]:
    for executor in list(EXECUTORS):
        state = state_of(executor)
        if state is not None:
            for record in [record for record in state.orphans if record.future.done()]:
                state.orphans.remove(record)  # in place: a dying worker may append meanwhile
            yield Observation(len(state.orphans), state.attributes)


def _observe_max_workers(options: CallbackOptions) -> Iterable[Observation]:
    for executor in list(EXECUTORS):
        state = state_of(executor)
        if state is not None:
            yield Observation(executor._max_workers, state.attributes)


def install(**kwargs: Any) -> None:
    """`ExecutorInstrumentor.instrument()`'s work, with its keyword arguments."""
    global _tracer, _context_var
    settings = start_settings(kwargs, "executor")
    if settings is None:
        return
    meter_ = start_meter(kwargs)
    _tracer = trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, tracer_provider=kwargs.get("tracer_provider"))
    _context_var = use_context()
    DURATIONS[:] = [
        Deferred(meter_, telemetry.EXECUTOR_QUEUE_DURATION, DURATIONS_LIMIT),
        Deferred(meter_, telemetry.EXECUTOR_RUN_DURATION, DURATIONS_LIMIT),
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
    instrument(meter_, telemetry.EXECUTOR_ORPHANED_OUTSTANDING, _observe_orphaned)
    interrupt.install(meter_, guard_raw_calls=settings.guard_async_exc)
    _zeroed.clear()
    for executor in list(EXECUTORS):  # pools built under an earlier instrumentation
        state = state_of(executor)
        if state is not None:
            state.bind_histograms()
            _zero_series(state)
    execution_timeouts.install(meter_)
    wrapt.wrap_function_wrapper(ThreadPoolExecutor, "__init__", _init_wrapper)
    cf_thread._WorkItem = WorkItem  # type: ignore[misc]  # what `submit` makes from now on
    wrapt.wrap_function_wrapper(cf_thread, "_worker", _worker_wrapper)
    logging.getLogger("concurrent.futures").addFilter(_DEATH_FILTER)


def uninstall(**kwargs: Any) -> None:
    global _tracer
    unwrap(ThreadPoolExecutor, "__init__")
    if cf_thread._WorkItem is WorkItem:
        cf_thread._WorkItem = _OriginalWorkItem  # type: ignore[misc]
    unwrap(cf_thread, "_worker")
    logging.getLogger("concurrent.futures").removeFilter(_DEATH_FILTER)
    interrupt.uninstall()
    execution_timeouts.uninstall()
    drain_histograms()
    DURATIONS.clear()
    _instruments.clear()
    _zeroed.clear()
    _tracer = None


INSTALLATION = Installation(install, uninstall)


def end_span_orphaned(record: ItemRecord, reason: str) -> None:
    """Close an orphaned item's span with an error (its worker will never close it)."""
    if record.span is not None:  # the detector already added the "stallwatch.wedge" event
        record.span.set_status(Status(StatusCode.ERROR, reason))
        record.span.end()
