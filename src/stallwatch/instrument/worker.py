"""The worker's side of a work item: `WorkItem.run`, the item run in its submitter's context, timed,
and scoped for `interrupt` and `execution_timeout`.

Invariants: the item's future is always completed, whatever lands in the worker; no interruption
lands after the item's scope ended (`_end_scope`); the item's bookkeeping is done before its future
is completed, so the awaiting thread does not wait for it. On CPython 3.10 to 3.13 (`_STOCK_RUN`)
`run` does what the stock `_WorkItem.run` does; other versions run the stock one inside the scope.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from functools import partial
from typing import Any

from opentelemetry import context as otel_context

from .. import interrupt, sdk_compat, telemetry
from .. import timeout as execution_timeouts
from ..core.faults import FAULTS
from ..sdk_compat import LightSpan
from .work_item import DURATIONS, DURATIONS_LIMIT, SETTING, ExecutorState, ItemRecord, _OriginalWorkItem

_current_item = interrupt.RUNNING  # worker thread ident -> the item it runs (kept by `interrupt`)
_delivering = interrupt.DELIVERING
# The lock-free end of an item relies on the GIL ordering its steps; without one, always lock.
_FREE_THREADED = not getattr(sys, "_is_gil_enabled", lambda: True)()
_monotonic_ns = time.monotonic_ns
_get_ident = threading.get_ident
_threads: dict[int, threading.Thread] = threading._active  # type: ignore[attr-defined]  # current_thread() reads it
_QUEUE_SECONDS = telemetry.WORK_ITEM_QUEUE_SECONDS.name
_RUN_SECONDS = telemetry.WORK_ITEM_RUN_SECONDS.name


class _ContextApi:
    """OpenTelemetry's context functions behind a ContextVar's `get`/`set`/`reset`."""

    get = staticmethod(otel_context.get_current)
    set = staticmethod(otel_context.attach)
    reset = staticmethod(otel_context.detach)


# OpenTelemetry's current context: its ContextVar, read and set directly (`sdk_compat.context_var`),
# or the API's functions (fast paths off, another runtime context); chosen at `instrument()`. Its
# `set` and `reset`, bound once: a worker calls them per item, some through `Context.run`.
_context_var: Any = _ContextApi
_set_context: Any = _ContextApi.set
_reset_context: Any = _ContextApi.reset


def use_context() -> Any:
    """Choose how work items read and set OpenTelemetry's current context, as `setup()` chose the fast
    paths; the choice, for the submitting side (`executor`) to use too."""
    global _context_var, _set_context, _reset_context
    _context_var = sdk_compat.context_var() or _ContextApi
    _set_context, _reset_context = _context_var.set, _context_var.reset
    return _context_var


class WorkItem(ItemRecord):
    """The work item `submit` makes while the instrumentation is on: an `ItemRecord` that runs itself."""

    def run(self, *args: Any) -> Any:
        """`_WorkItem.run`, timed, in the submitter's OpenTelemetry context, and scoped for `interrupt`.

        The item's scope ends and its bookkeeping is done *before* the future is completed:
        completing it wakes the awaiting thread, which would otherwise wait for the GIL while this
        worker did that work. Other versions than `_STOCK_RUN`'s run the stock `run` and do the
        same afterwards.
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
        lock a delivery holds (see `interrupt.DELIVERING`; not on every item, which would make it
        the instrumentation's largest cost per item). `outcome` is the exception
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
                entered = self.entered
                if entered is None:
                    _reset_context(token)
                else:  # in there: the copy may outlive the item
                    entered.run(_reset_context, token)
                    self.entered = None
            # The item stays in its pool's accounting log until the next submit or wedge check: what
            # it was given to run must not stay alive with it, as it does not without stallwatch.
            self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
            self.finished = True
            if execution_timeouts.OVERDUE:
                execution_timeouts.item_finished(self)
            ran = (_monotonic_ns() - started) / 1e9
            waited = (started - self.submitted) / 1e9
            if DURATIONS:
                waits, runs = state.durations
                if len(waits) < DURATIONS_LIMIT:
                    waits.append(waited)
                    runs.append(ran)
                else:
                    DURATIONS[0].dropped += 1
                    DURATIONS[1].dropped += 1
            span = self.span
            if span is not None:
                attributes = {_QUEUE_SECONDS: waited, _RUN_SECONDS: ran}
                if type(span) is LightSpan:  # the dict given at its start takes them: valid values
                    span.end_own(attributes)
                else:
                    span.set_attributes(attributes)
                    span.end()
        except Exception:
            FAULTS.record("executor", SETTING)


def _future_outcome(future: Any) -> BaseException | None:
    """The exception a completed future holds, else None."""
    if future.done() and not future.cancelled():
        return future.exception()
    return None


def _stock_run_shape() -> bool:
    """True when `_WorkItem.run` is the one `WorkItem.run` replicates (CPython 3.10 to 3.13)."""
    code = _OriginalWorkItem.run.__code__
    return code.co_argcount == 1 and {"set_running_or_notify_cancel", "fn", "args", "kwargs"} <= set(code.co_names)


_STOCK_RUN = _stock_run_shape()
_STOCK_OUTCOME = object()


def current_item(ident: int) -> ItemRecord | None:
    """The item a worker thread is running now, or None (idle, or not an instrumented worker)."""
    return _current_item.get(ident)


def _attach(item: ItemRecord) -> object:
    """In the worker: make the submitter's context (and the item's span in it) current where the item's
    function runs. Returns the token `_finish` resets it with (inside `item.entered` when that is set),
    or None when nothing was set."""
    try:
        fn = item.fn
        if type(fn) is partial and type(entered := getattr(fn.func, "__self__", None)) is contextvars.Context:
            # `asyncio.to_thread` (or a caller's own `Context.run`): the function runs in that context,
            # never in the worker's own, and sees the context it holds, as without stallwatch. Only the
            # item's span is set, in there. The context goes on the item, not in a wrapper around the
            # token: building one per item (a named tuple and its method call) cost more than the two
            # `Context.run` calls.
            if item.span is None:
                return None
            token = entered.run(_set_context, sdk_compat.with_span(item.context, item.span))  # type: ignore[arg-type]
            item.entered = entered
            return token
        if item.span is None:
            return _set_context(item.context)
        return _set_context(sdk_compat.with_span(item.context, item.span))  # type: ignore[arg-type]
    except Exception:
        FAULTS.record("executor", SETTING)
        return None
