"""Executor instrumentation: every `concurrent.futures.ThreadPoolExecutor`, including an event
loop's default executor (`run_in_executor`, `asyncio.to_thread`).

incident 002 in docs/incidents.md is a worker that died between `work_queue.get()` and `_WorkItem.run()`: the item
it had dequeued was referenced by nothing, its future stayed pending, and the awaiting request hung
with every counter healthy. No wrapper of `_WorkItem.run` can see that item, so stallwatch counts
the queue itself: each executor's `SimpleQueue` is replaced at construction by a subclass whose
`put` (called by `submit`) logs the item; `get` stays the C method, so a worker's dequeue runs no
Python code of ours. Items the queue has handed out (the log's head, all but its last `qsize()`,
FIFO) are "in flight"; `detect.wedge` finds the ones whose worker died. The module-level `_worker`
is wrapped to see a worker die the moment it happens. `_WorkItem` itself is replaced by a subclass,
`ItemRecord`, whose `run` times each item, carries the submitter's OpenTelemetry context into the
worker and scopes interruptions to the item (see `interrupt`): the item is its own record, and no
wrapper layer runs per item (a wrapt method wrapper alone costs 0.45 µs, measured; the budget is
2 µs per item, see `tests/bench/bench_executor.py`).

CPython internals used (3.10 to 3.13, the versions the tests run on): `ThreadPoolExecutor._work_queue`,
`_threads`, `_thread_name_prefix`, `_max_workers`, `_shutdown`, `_broken`, `_shutdown_lock`,
`_adjust_thread_count`, module `_worker`, `_shutdown`, `_global_shutdown_lock`, `_WorkItem.future`.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import thread as cf_thread
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.trace import Span, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation import _SPAN_KEY

from .. import interrupt, telemetry
from .. import timeout as execution_timeouts
from ..core import light_span
from ..core.faults import FAULTS, Deferred, instrument, meter
from ..core.scrub import MAX_NAME_CHARS, clip_text, scrub_text

SETTING = "STALLWATCH_INSTRUMENT_EXECUTOR"
_log = logging.getLogger("stallwatch")
_READ_LOCK_TIMEOUT = 1.0  # s; an executor's lock held longer (e.g. left held in a fork child) skips a check


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


_OriginalWorkItem = cf_thread._WorkItem


class ItemRecord(_OriginalWorkItem):
    """A work item made by `submit` while stallwatch is installed, and what stallwatch knows about it.

    `concurrent.futures.thread._WorkItem` is this class while the instrumentation is on, so the
    item is its own record: no second object per submission. Set in the submitting thread by the
    accounting queue's `put`: `executor` (None: the item went to a pool built before `instrument()`,
    which is not accounted), `submitted`, `context`, `span`; then in the worker: `started`,
    `thread`, `finished`; by the wedge check: `dequeued_seen`, `orphaned`; by `interrupt`:
    `interrupt`. Class attributes are the defaults: a field costs nothing until it is set.
    `submitted` and `started` are `time.monotonic_ns()` readings: a duration in seconds made from
    two of them is the float nearest to a whole number of ns, which `repr` (the span encoders)
    writes in half the time it takes for an arbitrary float (measured: 0.64 against 1.25 µs).
    """

    executor: ExecutorState | None = None
    submitted: int = 0
    context: otel_context.Context | None = None
    span: Span | None = None
    dequeued_seen: float | None = None  # when the wedge check first saw it handed out
    started: int | None = None
    thread: threading.Thread | None = None
    finished: bool = False
    orphaned: bool = False
    interrupt: Any = None  # the pending scoped interruption, see `interrupt`

    def run(self, *args: Any) -> Any:
        """`_WorkItem.run`, timed, in the submitter's OpenTelemetry context, and scoped for `interrupt`.

        On CPython 3.10 to 3.13 (`_STOCK_RUN`) it does what the stock `run` does, with the item's
        scope ended and its bookkeeping done *before* the future is completed: completing it wakes
        the awaiting thread, which otherwise waited for the GIL while this worker did that work
        (measured unpinned, `asyncio.to_thread`: +22 µs per item added that way, +9.5 this way).
        Other versions run the stock `run` and do the same afterwards.
        """
        state = self.executor
        if state is None:
            return _OriginalWorkItem.run(self, *args)
        if self.orphaned:
            return None  # already failed with WorkerDied: running it now would kill this worker too
        self.started = started = _monotonic_ns()
        ident = _get_ident()
        self.thread = _threads.get(ident) or threading.current_thread()
        if args or not _STOCK_RUN:
            return self._run_stock(state, started, ident, args)
        future = self.future
        if not future.set_running_or_notify_cancel():
            self._finish(state, started, None)  # cancelled while it waited
            return None
        # From here the item is `current_item()` of this thread. No lock: one dict store is atomic
        # under the GIL, and a delivery racing with it finds the thread idle and refuses, which is
        # right as the item had not started. Its end is another matter (`_end_scope`).
        token = _attach(self) if self.span is not None or self.context else None
        result = outcome = None
        _current_item[ident] = self  # the next instruction sets up the `try` (never a check point)
        try:
            try:
                try:
                    result = self.fn(*self.args, **self.kwargs)
                except BaseException as exc:
                    outcome = exc
            except BaseException as exc:  # landed in the handler above (Python 3.10 checks nearly everywhere)
                if not interrupt.is_ours(self, exc):
                    raise
                outcome = exc
            while True:  # in this frame: an interruption may land on `_end_scope`'s first instruction
                try:
                    self._end_scope(ident, outcome)
                    break
                except BaseException as exc:
                    if not interrupt.is_ours(self, exc):
                        raise
                    outcome = exc  # landed after the work returned: the item ends with it
            self._finish(state, started, token)
        finally:  # also when an exception not of ours landed above: the future never stays pending
            if outcome is None:
                future.set_result(result)
            else:
                future.set_exception(outcome)
                outcome = None  # break the reference cycle with the exception, as the stock `run` does
        return None

    def _run_stock(self, state: ExecutorState, started: int, ident: int, args: tuple[Any, ...]) -> Any:
        """The stock `run`, in the item's scope; the scope ends and the bookkeeping runs afterwards."""
        _current_item[ident] = self
        token = _attach(self) if self.span is not None or self.context else None
        try:
            return _OriginalWorkItem.run(self, *args)
        except BaseException as exc:
            if not interrupt.item_raised(self, exc):  # ours landed outside the item's try: worker lives
                raise
            return None
        finally:
            while True:  # as in `run`
                try:
                    self._end_scope(ident, _STOCK_OUTCOME)
                    break
                except BaseException as exc:
                    if not interrupt.item_raised(self, exc):
                        raise
            self._finish(state, started, token)

    def _end_scope(self, ident: int, outcome: object) -> None:
        """End the item's scope so that no interruption can land after it.

        Leave RUNNING, then, if a delivery concerns this item or may be under way, settle under the
        lock a delivery holds (see `interrupt.DELIVERING`; not on every item: measured, taking that
        lock was a fifth of what the instrumentation adds per item). `outcome` is the exception
        the item ended with (`_STOCK_OUTCOME`: the one its completed future holds). Called in a
        loop that catches an interruption landing at any check point here; running it again is
        harmless (an outcome is settled once).
        """
        _current_item.pop(ident, None)
        if self.interrupt is not None or _delivering or _FREE_THREADED:
            with interrupt.LOCK:
                if self.interrupt is not None:
                    if outcome is _STOCK_OUTCOME:
                        outcome = _future_outcome(self.future)
                    interrupt.settle_finished(self, outcome if isinstance(outcome, BaseException) else None)

    def _finish(self, state: ExecutorState, started: int, token: object) -> None:
        """The item is over: context back, durations, span, and what `execution_timeout` watches."""
        try:
            if token is not None:
                if type(token) is _InContext:
                    token.reset()
                else:
                    _context_var.reset(token)
            self.finished = True
            if execution_timeouts.OVERDUE:
                execution_timeouts.item_finished(self)
            ran = (_monotonic_ns() - started) / 1e9
            waited = (started - self.submitted) / 1e9
            if _histograms:
                waits, runs = state.durations
                if len(waits) < _HISTOGRAM_LIMIT:
                    waits.append(waited)
                    runs.append(ran)
                else:
                    _histograms[0].dropped += 1
                    _histograms[1].dropped += 1
            if self.span is not None:
                _end_span(self.span, waited, ran)
        except Exception:
            FAULTS.record("executor", SETTING)


def _future_outcome(future: Any) -> BaseException | None:
    """The exception a completed future holds, else None."""
    if future.done() and not future.cancelled():
        return future.exception()
    return None


def _stock_run_shape() -> bool:
    """True when `_WorkItem.run` is the one `ItemRecord.run` replicates (CPython 3.10 to 3.13)."""
    code = _OriginalWorkItem.run.__code__
    return code.co_argcount == 1 and {"set_running_or_notify_cancel", "fn", "args", "kwargs"} <= set(code.co_names)


_STOCK_RUN = _stock_run_shape()
_STOCK_OUTCOME = object()


@dataclass(eq=False)
class ExecutorState:
    """Per-executor accounting, reachable as `executor._stallwatch`."""

    name: str
    executor_ref: weakref.ReferenceType[ThreadPoolExecutor]
    in_flight: list[ItemRecord] = field(default_factory=list)
    deaths: list[tuple[threading.Thread, BaseException | None]] = field(default_factory=list)
    orphans: list[ItemRecord] = field(default_factory=list)  # orphaned items whose futures may not be done yet
    attributes: dict[str, str] = field(default_factory=dict)  # the metric attributes, built once
    span_name: str = ""
    # Where the queue and run durations of this pool's items wait for `drain_histograms()`.
    durations: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))

    def __post_init__(self) -> None:
        self.attributes = {telemetry.EXECUTOR_NAME.name: self.name}
        self.span_name = f"{self.name} work item"
        self.bind_histograms()

    def bind_histograms(self) -> None:
        """Append durations to the lists of the current instrumentation's histograms (if it is on)."""
        if _histograms:
            self.durations = (_histograms[0].values_for(self.attributes), _histograms[1].values_for(self.attributes))


class _AccountingQueue(queue.SimpleQueue):
    """The executor's work queue, logging what is put so that what was taken can be known.

    The log needs no lock of its own: `submit`, the only caller putting work items, holds the
    executor's `_shutdown_lock` (CPython 3.10 to 3.13 alike), and the readers here take it too
    (measured: a lock of ours took a fifth of what the instrumentation adds per item). Shutdown
    sentinels (None) are also put without it (`_worker`, `_python_exit`, the weakref callback): they
    are appended after the put and never prune, so a reader racing with one sees at most one item
    too few as handed out, which the next check corrects.
    """

    state: ExecutorState
    log: deque[ItemRecord | None]  # what was put and may not have been dequeued yet, in order
    lock: Any  # the executor's `_shutdown_lock`

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if type(item) is not ItemRecord:  # a shutdown sentinel, or an item of an older instrumentation
            _simple_put(self, item, block, timeout)
            self.log.append(None)
            return
        # Stamp the item in the submitting thread, inside `submit`.
        record = None
        try:
            item.executor, item.submitted = self.state, _monotonic_ns()
            context = _context_var.get()
            if context:  # an empty context (no span, no baggage) is falsy: nothing to carry over
                item.context = context
                if _tracer is not None:
                    _start_span(item, context)
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
        # so the log holds only what may still wait and no finished item stays alive until the
        # next wedge check (measured: that retention cost 5-13 us/item in GC).
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
_delivering = interrupt.DELIVERING
# The lock-free end of an item relies on the GIL ordering its steps; without one, always lock.
_FREE_THREADED = not getattr(sys, "_is_gil_enabled", lambda: True)()
_death_causes: dict[int, BaseException] = {}
_instruments: dict[str, Any] = {}
_histograms: list[Deferred] = []  # queue and run durations, in that order
_zeroed: set[str] = set()  # executor names whose series this instrumentation has made at zero
_HISTOGRAM_LIMIT = 100_000  # durations waiting per pool for the next drain; past that they are dropped
_monotonic_ns = time.monotonic_ns
_get_ident = threading.get_ident
_threads: dict[int, threading.Thread] = threading._active  # type: ignore[attr-defined]  # current_thread() reads it
_simple_put = queue.SimpleQueue.put
_timeout_scope = execution_timeouts.SCOPE


class _ContextApi:
    """OpenTelemetry's context functions behind a ContextVar's `get`/`set`/`reset`."""

    get = staticmethod(otel_context.get_current)
    set = staticmethod(otel_context.attach)
    reset = staticmethod(otel_context.detach)


# OpenTelemetry's current context is one ContextVar in `ContextVarsRuntimeContext`, the runtime
# context the API ships (1.27 to 1.45 alike): read and set it directly, as `get_current()`,
# `attach()` and `detach()` do through two Python frames each. Another runtime context
# (OTEL_PYTHON_CONTEXT) goes through the API.
_context_var: Any = getattr(otel_context._RUNTIME_CONTEXT, "_current_context", None)
if not isinstance(_context_var, contextvars.ContextVar):
    _context_var = _ContextApi
_tracer: trace.Tracer | None = None
# Span types told without `isinstance` against the API's abstract `Span` (0.5 µs per item)
_SPAN_TYPES = frozenset(
    {sdk_trace.Span, sdk_trace._Span, light_span.LightSpan, trace.NonRecordingSpan, light_span.ShedSpan}
)
_SAMPLED = TraceFlags.SAMPLED
_LightSpan = light_span.LightSpan
_dict_set = dict.__setitem__
_QUEUE_SECONDS = telemetry.WORK_ITEM_QUEUE_SECONDS.name
_RUN_SECONDS = telemetry.WORK_ITEM_RUN_SECONDS.name


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
    for deferred in _histograms:
        deferred.zero(state.attributes)


def drain_histograms() -> None:
    """Hand the queue/run durations waiting since the last drain to the SDK histograms.

    Called every wedge check (0.5 s) and before each metric collection: a work item only appends
    its two durations to two lists (`ExecutorState.durations`), instead of two SDK `record()` calls
    (4-10 µs).
    """
    for deferred in _histograms:
        deferred.drain()


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


def _start_span(item: ItemRecord, context: otel_context.Context) -> None:
    """In the submitting thread: the item's span, when the submitter is inside a sampled trace.

    What `trace.get_current_span(context).get_span_context()` and its `is_valid` and
    `trace_flags.sampled` give, read from the context and the `SpanContext` tuple directly (six
    Python calls fewer per item; the tuple's layout is the same from API 1.27 to 1.45)."""
    current = context.get(_SPAN_KEY)
    if current is None or not (type(current) in _SPAN_TYPES or isinstance(current, Span)):
        return
    parent = current.get_span_context()  # type: ignore[attr-defined]  # a span: its type checked above
    _, _, _, flags, _, valid = parent  # the `SpanContext` tuple's layout
    if valid and flags & _SAMPLED:
        state = item.executor  # set, as `_tracer` is, when `put` calls this
        item.span = light_span.start(
            _tracer,  # type: ignore[arg-type]
            state.span_name,  # type: ignore[union-attr]
            context,
            state.attributes,  # type: ignore[union-attr]
            parent=parent,
            shed=True,
        )


def _attach(item: ItemRecord) -> object:
    """In the worker: make the submitter's context (and the item's span in it) current."""
    try:
        if item.span is None:
            return _context_var.set(item.context)
        # `trace.set_span_in_context(item.span, item.context)` with one copy of the context, not
        # two (`set_value` copies it, then `Context()` copies that): the key is set in the copy,
        # which nothing else holds yet, past the immutable Context's `__setitem__`
        context = otel_context.Context(item.context)  # type: ignore[arg-type]  # set: the item has a span
        _dict_set(context, _SPAN_KEY, item.span)
        fn = item.fn
        if type(fn) is partial and type(entered := getattr(fn.func, "__self__", None)) is contextvars.Context:
            # `asyncio.to_thread`: the function runs in a copy of the submitter's contextvars
            # (`partial(ctx.run, func)`), where a context set in the worker's own is not seen.
            # Set it in that copy, for the item's span to be current in there too.
            return _InContext(entered, entered.run(_context_var.set, context))
        return _context_var.set(context)
    except Exception:
        FAULTS.record("executor", SETTING)
        return None


class _InContext(NamedTuple):
    """A context set inside the contextvars `Context` a work item runs its function in (a tuple:
    a frozen dataclass takes a microsecond to build, through `object.__setattr__`)."""

    entered: contextvars.Context
    token: contextvars.Token[Any]

    def reset(self) -> None:
        self.entered.run(_context_var.reset, self.token)  # in there: the copy may outlive the item


def _end_span(span: Span, queue_seconds: float, run_seconds: float) -> None:
    if type(span) is _LightSpan:
        attributes: Any = span._attributes  # the dict given at its start: the durations are valid values
        attributes[_QUEUE_SECONDS] = queue_seconds
        attributes[_RUN_SECONDS] = run_seconds
    else:
        span.set_attributes({_QUEUE_SECONDS: queue_seconds, _RUN_SECONDS: run_seconds})
    span.end()


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


class ExecutorInstrumentor(BaseInstrumentor):
    """Instruments every ThreadPoolExecutor built after `instrument()` (and the death hook for all).

    Keyword arguments of `instrument()`: `meter_provider`, `tracer_provider` (default: the global
    ones) and `settings` (a `stallwatch.Settings`; default: read from the environment), which set
    the raw `SetAsyncExc` guard and the wedge detector (interval, stall threshold, heal).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        global _tracer
        from ..config import ConfigError, Settings
        from ..detect import wedge

        try:
            settings = kwargs.get("settings") or Settings.load()
        except ConfigError as exc:
            _log.error("stallwatch: %s; executor instrumentation stays off.", exc)
            return
        meter_ = meter(kwargs.get("meter_provider"))
        FAULTS.bind(kwargs.get("meter_provider"))
        _tracer = trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, tracer_provider=kwargs.get("tracer_provider"))
        _histograms[:] = [
            Deferred(meter_, telemetry.EXECUTOR_QUEUE_DURATION, _HISTOGRAM_LIMIT),
            Deferred(meter_, telemetry.EXECUTOR_RUN_DURATION, _HISTOGRAM_LIMIT),
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
        wedge.configure(
            wedge.WedgeSettings(settings.wedge_check_interval, settings.queue_stall_seconds, settings.executor_heal)
        )
        wedge.ensure_running()
        wrapt.wrap_function_wrapper(ThreadPoolExecutor, "__init__", _init_wrapper)
        cf_thread._WorkItem = ItemRecord  # type: ignore[misc]  # what `submit` makes from now on
        wrapt.wrap_function_wrapper(cf_thread, "_worker", _worker_wrapper)
        logging.getLogger("concurrent.futures").addFilter(_DEATH_FILTER)

    def _uninstrument(self, **kwargs: Any) -> None:
        global _tracer
        unwrap(ThreadPoolExecutor, "__init__")
        if cf_thread._WorkItem is ItemRecord:
            cf_thread._WorkItem = _OriginalWorkItem  # type: ignore[misc]
        unwrap(cf_thread, "_worker")
        logging.getLogger("concurrent.futures").removeFilter(_DEATH_FILTER)
        interrupt.uninstall()
        execution_timeouts.uninstall()
        drain_histograms()
        _histograms.clear()
        _instruments.clear()
        _zeroed.clear()
        _tracer = None


def end_span_orphaned(record: ItemRecord, reason: str) -> None:
    """Close an orphaned item's span with an error (its worker will never close it)."""
    if record.span is not None:  # the detector already added the "stallwatch.wedge" event
        record.span.set_status(Status(StatusCode.ERROR, reason))
        record.span.end()
