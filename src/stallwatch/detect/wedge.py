"""Wedge detection for executors: the request that awaits forever while every counter is healthy.

A worker's death is recorded the moment `_worker` returns abnormally (`instrument.pools`). A
periodic check (a task on stallwatch's worker thread, added on first need, and again in a fork
child that lives on) then finds what the death left behind:

- `orphaned_item`: an item a dead worker had dequeued but never ran (its future stays PENDING;
  found by queue accounting) or was running (RUNNING, owner thread dead);
- `queue_stalled`: items waiting longer than `STALLWATCH_QUEUE_STALL_SECONDS` with no live worker;
- `execution_overdue`: guarded work past its deadline (`stallwatch.execution_timeout`).

Each is counted (`stallwatch.wedge.detected`), logged at WARNING with the thread name in a record
carrying the submitter's trace and span ids, added as an event to the item's span, and sent to
Sentry when sentry-sdk is initialised. `STALLWATCH_EXECUTOR_HEAL=true` fails an orphaned future
with `WorkerDied` and replaces dead workers (docs/executors.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from opentelemetry import trace

from .. import telemetry
from .. import timeout as execution_timeouts
from ..core import background
from ..core.faults import FAULTS, to_sentry
from ..core.scrub import MAX_NAME_CHARS, scrub_text
from ..instrument import pools as ex
from ..instrument.work_item import ExecutorState, ItemRecord, WorkerDied

_log = logging.getLogger("stallwatch")


class WedgeSettings:
    """How the detector runs; set by `setup()` from `STALLWATCH_*` settings."""

    def __init__(self, interval: float = 0.5, queue_stall_seconds: float = 5.0, heal: bool = False) -> None:
        self.interval = interval
        self.queue_stall_seconds = queue_stall_seconds
        self.heal = heal


SETTINGS = WedgeSettings()
_lock = threading.Lock()
_task: background.Task | None = None  # the periodic check in this process
_stalled: set[int] = set()  # id() of executors already reported stalled (once per episode)
_overdue_reported: set[int] = set()  # id() of item records already reported overdue


def configure(settings: WedgeSettings) -> None:
    global SETTINGS
    SETTINGS = settings


def install(settings: WedgeSettings) -> None:
    """Watch every accounted executor: be told of each worker's death (`executor.on_worker_death`)
    and check for wedges every `settings.interval` seconds on stallwatch's worker."""
    configure(settings)
    ex.on_worker_death(worker_died)
    ensure_running()


def ensure_running() -> None:
    """Run the check on stallwatch's worker (`background`) in this process, if it does not yet
    (first use, or a fork child that lives on)."""
    global _task
    if _task is not None and _task.pid == os.getpid():
        return
    with _lock:
        if _task is None or _task.pid != os.getpid():
            _task = background.every(SETTINGS.interval, _check_and_drain)


def _check_and_drain() -> None:
    try:
        check()
        ex.drain_histograms()
    except Exception:
        FAULTS.record("wedge detector", "STALLWATCH_INSTRUMENT_EXECUTOR")


def check() -> None:
    """One pass over every instrumented executor."""
    now = time.monotonic()
    for executor in list(ex.EXECUTORS):
        state = ex.state_of(executor)
        if state is not None:
            _check_executor(executor, state, now)
    _check_overdue(now)


def _check_overdue(now: float) -> None:
    """Report guarded work still running past its execution_timeout deadline, once per item."""
    _overdue_reported.intersection_update(execution_timeouts.OVERDUE)
    for key, (record, deadline, name) in list(execution_timeouts.OVERDUE.items()):
        state = record.executor
        if key in _overdue_reported or state is None:  # None: never accounted (see `ItemRecord`)
            continue
        _overdue_reported.add(key)
        thread = record.thread.name if record.thread is not None else "?"
        _report(
            "execution_overdue",
            state,
            record,
            f"work guarded by execution_timeout {name!r} is still running in {thread}, "
            f"{now - deadline:.1f}s past its deadline (a timeout cannot stop a thread)",
            {telemetry.EXECUTION_NAME.name: name, telemetry.THREAD_NAME.name: scrub_text(thread, MAX_NAME_CHARS)},
            {"seconds_past_deadline": round(now - deadline, 3)},
        )


def _check_executor(executor: Any, state: ExecutorState, now: float) -> None:
    work_queue = executor._work_queue
    if isinstance(work_queue, ex._AccountingQueue):
        for record in work_queue.take_handed_out():
            record.dequeued_seen = now
            state.in_flight.append(record)
    still: list[ItemRecord] = []
    for record in state.in_flight:
        if record.finished or record.orphaned or record.future.done():
            continue
        if record.started is None:
            # Dequeued, not started: orphaned once a worker death (not already matched to an item)
            # explains it and a live worker had time to start it.
            if state.deaths and now - (record.dequeued_seen or now) >= SETTINGS.interval:
                thread, cause = state.deaths.pop(0)
                _orphan(executor, state, record, thread, cause, dequeued_only=True)
                continue
        elif record.thread is not None and not record.thread.is_alive():
            _orphan(executor, state, record, record.thread, None, dequeued_only=False)
            continue
        still.append(record)
    state.in_flight = still
    _check_stall(executor, state, now)


def _check_stall(executor: Any, state: ExecutorState, now: float) -> None:
    work_queue = executor._work_queue
    alive = any(t.is_alive() for t in list(executor._threads))
    if alive or work_queue.qsize() == 0:
        _stalled.discard(id(executor))
        return
    waiting = list(getattr(work_queue, "log", ()))
    oldest = min((r.submitted / 1e9 for r in waiting if r is not None), default=now)
    if now - oldest >= SETTINGS.queue_stall_seconds and id(executor) not in _stalled:
        _stalled.add(id(executor))
        _report(
            "queue_stalled",
            state,
            None,
            f"{work_queue.qsize()} item(s) waiting up to {now - oldest:.1f}s in executor {state.name} "
            "and none of its workers is alive",
            {},
            {
                "items_waiting": work_queue.qsize(),
                "oldest_wait_seconds": round(now - oldest, 3),
                "healed": SETTINGS.heal,
            },
        )
        if SETTINGS.heal:
            _respawn(executor)


def worker_died(
    state: ExecutorState, thread: threading.Thread, cause: BaseException | None, held: ItemRecord | None
) -> None:
    """Called in the dying worker itself, the moment `_worker` returns abnormally."""
    ensure_running()
    cause_text = f"{type(cause).__name__}: {scrub_text(cause)}" if cause is not None else "unknown cause"
    name = scrub_text(thread.name, MAX_NAME_CHARS)
    _report(
        "worker_died",
        state,
        held,
        f"executor worker {name} died ({cause_text})",
        {telemetry.ERROR_TYPE.name: type(cause).__name__ if cause else None, telemetry.THREAD_NAME.name: name},
        {"cause": cause_text, "held_an_item": held is not None},
    )
    executor = state.executor_ref()
    if held is not None and not held.future.done() and executor is not None:
        if (thread, cause) in state.deaths:
            state.deaths.remove((thread, cause))  # matched: it cannot also have dequeued another item
        _orphan(executor, state, held, thread, cause, dequeued_only=False)


def _orphan(
    executor: Any,
    state: ExecutorState,
    record: ItemRecord,
    thread: threading.Thread | None,
    cause: BaseException | None,
    *,
    dequeued_only: bool,
) -> None:
    name = scrub_text(thread.name, MAX_NAME_CHARS) if thread is not None else "?"
    record.orphaned = True
    state.orphans.append(record)
    ex._add(telemetry.EXECUTOR_ORPHANED, 1, state.attributes)
    what = "dequeued it and died before running it" if dequeued_only else "died while running it"
    age = time.monotonic() - record.submitted / 1e9
    _report(
        "orphaned_item",
        state,
        record,
        f"an item submitted {age:.1f}s ago to executor {state.name} will never complete: worker {name} {what}",
        {telemetry.THREAD_NAME.name: name if thread is not None else None},
        {
            "item_age_seconds": round(age, 3),
            "worker_died_before_running_it": dequeued_only,
            "cause": f"{type(cause).__name__}: {scrub_text(cause)}" if cause is not None else None,
            "healed": SETTINGS.heal,
        },
    )
    ex.end_span_orphaned(record, f"worker {name} {what}")
    if SETTINGS.heal:
        if not record.future.done():
            record.future.set_exception(WorkerDied(name, cause, dequeued_only))
            ex._add(telemetry.EXECUTOR_HEALED, 1, state.attributes)
        _respawn(executor)


def _respawn(executor: Any) -> None:
    """Drop dead workers from the pool's accounting and start replacements (heal only)."""
    from concurrent.futures import thread as cf_thread

    with executor._shutdown_lock, cf_thread._global_shutdown_lock:
        if executor._shutdown:
            return
        executor._threads -= {t for t in executor._threads if not t.is_alive()}
        for _ in range(executor._max_workers + 1):
            alive = sum(1 for t in executor._threads if t.is_alive())
            if executor._work_queue.qsize() == 0 or alive >= executor._max_workers:
                break
            executor._adjust_thread_count()  # may only eat a stale idle token; then try again


def _report(
    kind: str,
    state: ExecutorState,
    record: ItemRecord | None,
    message: str,
    tags: dict[str, Any],
    context: dict[str, Any],
) -> None:
    """Count, log, add to the item's span and send to Sentry one detection; `tags` and `context`
    are the Sentry event's facts beyond the executor and the message (`telemetry.SENTRY_EVENTS`)."""
    trace_id = span_id = ""
    span_context = trace.INVALID_SPAN_CONTEXT
    if record is not None:
        span_context = trace.get_current_span(record.context).get_span_context()
        if span_context.is_valid:
            trace_id, span_id = f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}"
        if record.span is not None and record.span.is_recording():
            record.span.add_event("stallwatch.wedge", {telemetry.WEDGE_KIND.name: kind, "message": message})
    hint = "" if SETTINGS.heal or kind not in ("orphaned_item", "queue_stalled") else (
        " STALLWATCH_EXECUTOR_HEAL=true fails such items with stallwatch.WorkerDied and restores the pool."
    )  # fmt: skip
    # Made current around the count and the record: the count's exemplar (OTLP, SDK 1.28+) and the
    # record carry the submitter's trace and span ids.
    submitter = trace.NonRecordingSpan(span_context) if trace_id else trace.INVALID_SPAN
    with trace.use_span(submitter, end_on_exit=False):
        ex._add(telemetry.WEDGE_DETECTED, 1, {**state.attributes, telemetry.WEDGE_KIND.name: kind})
        _log.warning(
            "stallwatch: wedge %s: %s%s.%s",
            kind,
            message,
            f" (trace {trace_id})" if trace_id else "",
            hint,
            extra={"stallwatch.wedge.kind": kind, "stallwatch.executor.name": state.name},
        )
    to_sentry(
        kind,
        {telemetry.EXECUTOR_NAME.name: state.name, **tags},
        {"description": f"{message}.", **context},
        trace_id,
        span_id,
    )
