"""Scoped interruption of executor work (incident 002 in docs/incidents.md).

`PyThreadState_SetAsyncExc` schedules an exception that fires at the target's next check point,
which for a thread parked in a C call is whenever that call returns — by then a pooled worker may
be running someone else's item, or sitting between `work_queue.get()` and `_WorkItem.run()`, where
the exception kills it and strands the item it holds. An interruption here belongs to the work item
running when it was asked for: it is delivered only while that item runs (under one lock), and the
item's end revokes it (`SetAsyncExc(tid, NULL)`) if it has not landed. The same scoping is applied
to raw `ctypes.pythonapi.PyThreadState_SetAsyncExc` calls aimed at executor workers
(`STALLWATCH_GUARD_ASYNC_EXC`, default on): never delivered to an idle worker, never left pending
across items; the caller still gets the return value it expects. Other threads pass through.
CPython offers nothing like this, hence the hand-written code.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import TYPE_CHECKING, Any

from . import telemetry
from .core.faults import instrument, to_sentry
from .core.scrub import MAX_NAME_CHARS, scrub_text

if TYPE_CHECKING:
    from .instrument.work_item import ItemRecord

_log = logging.getLogger("stallwatch")
_real_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
LOCK = threading.Lock()  # held while an interruption is delivered, and while an item it may concern ends
# Idents a delivery is looking at, added (under LOCK) before it looks the item up in RUNNING. An
# item's end takes LOCK only when a delivery concerns it or may be under way: it removes itself from
# RUNNING, then reads its `interrupt` and this set. A delivery that finds neither was not yet looking,
# so it will not find the item either (every step is one atomic operation under the GIL).
DELIVERING: set[int] = set()
RUNNING: dict[int, ItemRecord] = {}  # worker ident -> item it runs, while the item runs
_worker_idents: set[int] = set()
_counters: dict[str, Any] = {}


class Interrupted(BaseException):
    """Raised inside a work item by `interrupt_thread()` (a BaseException, like SystemExit, so
    `except Exception` in the work does not swallow it; unlike SystemExit, asyncio does not re-raise it)."""


class _Pending:
    def __init__(self, exc_type: type[BaseException], via: str) -> None:
        self.exc_type = exc_type
        self.via = via  # "api" or "raw"
        self.done = threading.Event()
        self.outcome: str | None = None


def _count(metric: telemetry.Metric, record: ItemRecord | None) -> None:
    counter = _counters.get(metric.name)
    if counter is not None:
        name = record.executor.name if record is not None and record.executor is not None else "unknown"
        counter.add(1, {telemetry.EXECUTOR_NAME.name: name})


def _settle(record: ItemRecord, outcome: str) -> None:
    """Under LOCK: decide a pending interruption's outcome once."""
    pending = record.interrupt
    if pending is None or pending.outcome is not None:
        return
    if outcome == "revoked" and record.thread is not None and record.thread.ident is not None:
        _real_set_async_exc(ctypes.c_ulong(record.thread.ident), None)  # NULL clears; never py_object(None)
    pending.outcome = outcome
    pending.done.set()
    _count(telemetry.ASYNC_EXC_DELIVERED if outcome == "delivered" else telemetry.ASYNC_EXC_REVOKED, record)


# ---- called by the executor instrumentation, in the worker thread -----------------------------


def worker_started() -> None:
    _worker_idents.add(threading.get_ident())


def worker_stopped() -> None:
    _worker_idents.discard(threading.get_ident())


def is_ours(record: ItemRecord, exc: BaseException) -> bool:
    """True if `exc` is the interruption scheduled for this item."""
    pending = record.interrupt
    return pending is not None and isinstance(exc, pending.exc_type)


def item_raised(record: ItemRecord, exc: BaseException) -> bool:
    """An exception escaped the stock `_WorkItem.run`: True if it is our interruption (then it is handled)."""
    if not is_ours(record, exc):
        return False
    if not record.future.done():
        record.future.set_exception(exc)  # it landed outside the item's try: complete the future
    return True


def settle_finished(record: ItemRecord, outcome: BaseException | None) -> None:
    """Under LOCK, as the item's scope ends (`worker.WorkItem.run`), `outcome` being the exception the
    item ended with: an interruption still pending is revoked; one that landed is recorded as delivered."""
    pending = record.interrupt
    if pending is not None:  # `_settle` decides only once
        _settle(record, "delivered" if isinstance(outcome, pending.exc_type) else "revoked")


# ---- public API ---------------------------------------------------------------------------------


class Work:
    """Handle of one executor work item, from `current_work()`; target of `interrupt_thread()`."""

    def __init__(self, record: ItemRecord) -> None:
        self._record = record

    @property
    def thread_name(self) -> str:
        return self._record.thread.name if self._record.thread is not None else "?"


def current_work() -> Work | None:
    """The work item the calling executor thread runs, to interrupt exactly it later.

    Keep it per request (never in a slot shared by overlapping requests: incident 002's second
    bug) and pass it to `interrupt_thread()`; it then never hits another request's item.
    """
    record = RUNNING.get(threading.get_ident())
    return Work(record) if record is not None else None


def interrupt_thread(
    target: Work | threading.Thread | int, exc_type: type[BaseException] = Interrupted, timeout: float | None = 1.0
) -> str:
    """Interrupt executor work and say what happened.

    `target` is a `Work` handle from `current_work()` (only that item is ever interrupted), or a
    thread / thread ident (whatever item it runs now). Returns `"delivered"` (the exception was
    raised inside that item), `"revoked"` (the item ended, or `timeout` seconds passed, e.g. it
    is parked in a C call, before the exception landed; it was cleared and will never fire
    later), `"refused_idle"` (no such item is running: nothing was scheduled) or `"no_such_thread"`.
    """
    if isinstance(target, Work):
        thread = target._record.thread
        ident = thread.ident if thread is not None else None
    else:
        ident = target.ident if isinstance(target, threading.Thread) else int(target)
    with LOCK:
        DELIVERING.add(ident or -1)
        try:
            record = RUNNING.get(ident or -1)
            if isinstance(target, Work) and record is not target._record:
                _count(telemetry.ASYNC_EXC_REFUSED, target._record)
                return "refused_idle"
            if record is None or ident is None:  # no thread ident: no item runs it either
                alive = any(t.ident == ident for t in threading.enumerate())
                _count(telemetry.ASYNC_EXC_REFUSED, None)
                return "refused_idle" if alive else "no_such_thread"
            pending = _Pending(exc_type, "api")
            record.interrupt = pending
            _real_set_async_exc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))
            _count(telemetry.ASYNC_EXC_INJECTED, record)
        finally:
            DELIVERING.discard(ident or -1)
    if not pending.done.wait(timeout):
        with LOCK:
            _settle(record, "revoked")
    return pending.outcome or "revoked"


class _GuardedSetAsyncExc:
    """Stands in for `ctypes.pythonapi.PyThreadState_SetAsyncExc` (STALLWATCH_GUARD_ASYNC_EXC)."""

    argtypes: Any = None
    restype: Any = None

    def __call__(self, tid: Any, exc: Any) -> int:
        ident = int(getattr(tid, "value", tid))
        if ident not in _worker_idents:
            return int(_real_set_async_exc(tid, exc))
        exc_type = exc.value if isinstance(exc, ctypes.py_object) else exc
        with LOCK:
            DELIVERING.add(ident)
            try:
                delivered = self._deliver(ident, exc_type)
            finally:
                DELIVERING.discard(ident)
        if delivered is None:
            _refused(ident, exc_type)
            return 1  # the thread exists: what the caller expects to see
        return delivered

    @staticmethod
    def _deliver(ident: int, exc_type: Any) -> int | None:
        """Under LOCK, with `ident` in DELIVERING; None when the call is refused."""
        record = RUNNING.get(ident)
        if exc_type is None:  # a clear: pass it on, and forget our pending record
            if record is not None and record.interrupt is not None and record.interrupt.outcome is None:
                record.interrupt.outcome = "revoked"
                record.interrupt.done.set()
            return int(_real_set_async_exc(ctypes.c_ulong(ident), None))
        if record is None or not isinstance(exc_type, type) or not issubclass(exc_type, BaseException):
            _count(telemetry.ASYNC_EXC_REFUSED, None)
            return None
        record.interrupt = _Pending(exc_type, "raw")
        _count(telemetry.ASYNC_EXC_INJECTED, record)
        return int(_real_set_async_exc(ctypes.c_ulong(ident), ctypes.py_object(exc_type)))


def _refused(ident: int, exc_type: Any) -> None:
    """Report a refused raw call (outside LOCK: Sentry's client runs the host's `before_send`)."""
    from opentelemetry import trace

    name = getattr(exc_type, "__name__", None) or scrub_text(exc_type, MAX_NAME_CHARS)
    message = (
        f"refused PyThreadState_SetAsyncExc({name}) on idle executor worker {ident}: it would kill the worker and "
        "strand the next item (incident 002 in docs/incidents.md)"
    )
    _log.warning("stallwatch: %s. STALLWATCH_GUARD_ASYNC_EXC=false passes such calls through.", message)
    worker = next((thread for thread in threading.enumerate() if thread.ident == ident), None)
    caller = trace.get_current_span().get_span_context()  # the request whose timeout fired, if traced
    to_sentry(
        "stale_async_exception",
        {
            telemetry.ERROR_TYPE.name: name,
            telemetry.THREAD_NAME.name: scrub_text(worker.name, MAX_NAME_CHARS) if worker is not None else None,
        },
        {"description": f"{message}."},
        f"{caller.trace_id:032x}" if caller.is_valid else "",
        f"{caller.span_id:016x}" if caller.is_valid else "",
    )


def install(meter_: Any, guard_raw_calls: bool) -> None:
    """Create the counters; with `guard_raw_calls`, scope raw ctypes calls aimed at workers."""
    for metric in (
        telemetry.ASYNC_EXC_INJECTED,
        telemetry.ASYNC_EXC_DELIVERED,
        telemetry.ASYNC_EXC_REVOKED,
        telemetry.ASYNC_EXC_REFUSED,
    ):
        _counters[metric.name] = instrument(meter_, metric)
    if guard_raw_calls:
        ctypes.pythonapi.PyThreadState_SetAsyncExc = _GuardedSetAsyncExc()  # type: ignore[attr-defined]


def zero(attributes: dict[str, str]) -> None:
    """The counters of an executor (`attributes`: its name) at zero, before its first interruption."""
    for counter in list(_counters.values()):
        counter.add(0, attributes)


def uninstall() -> None:
    """Give `ctypes.pythonapi.PyThreadState_SetAsyncExc` back."""
    if isinstance(getattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", None), _GuardedSetAsyncExc):
        ctypes.pythonapi.PyThreadState_SetAsyncExc = _real_set_async_exc  # type: ignore[attr-defined]
    _counters.clear()
