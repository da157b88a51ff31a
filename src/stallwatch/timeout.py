"""`execution_timeout`: a timeout armed before the first await, that keeps watching the thread
work it guarded; and cheap counters of asyncio timeouts by call site.

In incident 002 in docs/incidents.md the second request hung at its first `await asyncio.to_thread(...)`, and its
execution timeout — armed only later, at `asyncio.wait(..., timeout=)` — never started. A scope
entered at the top of the request times that await out too. A timeout cannot stop a thread,
though: work the scope submitted to an executor keeps running after the deadline, so it is
watched (`stallwatch.execution.overdue` now, `stallwatch.execution.overrun.duration` when it
ends, and a `execution_overdue` wedge report). On 3.11+ the scope is `asyncio.timeout`; 3.10 has
no `asyncio.timeout`, so the same cancel-and-convert is done here (the only version difference).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import wrapt
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation

from . import telemetry
from .core.faults import FAULTS, Deferred, instrument

if TYPE_CHECKING:
    from .instrument.work_item import ItemRecord

T = TypeVar("T")
# The innermost execution_timeout around the running code; the executor's `put` adds each item
# submitted inside it to its `items`.
SCOPE: contextvars.ContextVar[execution_timeout | None] = contextvars.ContextVar(
    "stallwatch_execution_timeout", default=None
)
_instruments: dict[str, Any] = {}
_names: set[str] = set()  # scope names whose series exist: made at zero when the first scope of a name starts
OVERDUE: dict[int, tuple[ItemRecord, float, str]] = {}  # id(record) -> (record, deadline, scope name)
COMPONENT, SETTING = "executor", "STALLWATCH_INSTRUMENT_EXECUTOR"  # what counts and turns off these faults


def _fault() -> None:
    """Call from an `except Exception` block: the host's timeout or wait goes ahead unchanged."""
    FAULTS.record(COMPONENT, SETTING)


class execution_timeout:  # lower case: used like asyncio.timeout
    """Time out a request body after `seconds`, armed at entry, before its first `await`.

    Use as ``async with stallwatch.execution_timeout(20, name="trace"):`` or as a decorator of an
    ``async def``. On expiry the body is cancelled and ``TimeoutError`` is raised, the timeout is
    counted (`stallwatch.execution.timeouts` {`stallwatch.execution.name`}) and added as an event
    to the current span. Executor work submitted inside the scope (``asyncio.to_thread``,
    ``run_in_executor``) cannot be stopped by a timeout; stallwatch keeps watching it and reports
    how long it ran past the deadline.
    """

    def __init__(self, seconds: float, name: str = "default") -> None:
        if not seconds > 0:
            raise ValueError(f"execution_timeout seconds must be positive, not {seconds!r}")
        self.seconds = seconds
        self.name = name
        self.deadline = 0.0
        self.items: list[ItemRecord] = []
        self._inner: Any = None
        self._token: contextvars.Token[execution_timeout | None] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._expired = False

    async def __aenter__(self) -> execution_timeout:
        if self.name not in _names and _instruments:
            _declare(self.name)
        self.deadline = time.monotonic() + self.seconds
        self._token = SCOPE.set(self)
        if hasattr(asyncio, "timeouts"):
            self._inner = asyncio.timeouts.timeout(self.seconds)  # not asyncio.timeout: not counted twice
            await self._inner.__aenter__()
        else:  # Python 3.10
            task = asyncio.current_task()
            assert task is not None, "execution_timeout needs a running task"
            self._handle = asyncio.get_running_loop().call_later(self.seconds, self._expire_310, task)
        return self

    def _expire_310(self, task: asyncio.Task[Any]) -> None:
        self._expired = True
        task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if self._token is not None:
            SCOPE.reset(self._token)
        try:
            if self._inner is not None:
                return await self._inner.__aexit__(exc_type, exc, tb)
            if self._handle is not None:
                self._handle.cancel()
            if self._expired and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
            return None
        except TimeoutError:
            try:
                self._record_expiry()
            except Exception:
                _fault()
            raise

    def __call__(self, function: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        seconds, name = self.seconds, self.name

        @functools.wraps(function)
        async def guarded(*args: Any, **kwargs: Any) -> T:
            async with execution_timeout(seconds, name):
                return await function(*args, **kwargs)

        return guarded

    def _record_expiry(self) -> None:
        attributes = {telemetry.EXECUTION_NAME.name: self.name}
        counter = _instruments.get(telemetry.EXECUTION_TIMEOUTS.name)
        if counter is not None:
            counter.add(1, attributes)
        trace.get_current_span().add_event("stallwatch.execution.timeout", {**attributes, "seconds": self.seconds})
        for record in self.items:
            if record.started is not None and not record.finished:
                OVERDUE[id(record)] = (record, self.deadline, self.name)


def _declare(name: str) -> None:
    """The series of scope `name` at zero, before its first expiry or overrun: Prometheus sees no
    increase in a series born with its first value."""
    try:
        _names.add(name)
        attributes = {telemetry.EXECUTION_NAME.name: name}
        _instruments[telemetry.EXECUTION_TIMEOUTS.name].add(0, attributes)
        _instruments[telemetry.EXECUTION_OVERRUN_DURATION.name].zero(attributes)
    except Exception:
        _fault()


def item_finished(record: ItemRecord) -> None:
    """Called when an item ends: if it had overrun its scope's deadline, record by how much."""
    entry = OVERDUE.pop(id(record), None)
    if entry is not None:
        _, deadline, name = entry
        histogram = _instruments.get(telemetry.EXECUTION_OVERRUN_DURATION.name)
        if histogram is not None:
            try:
                histogram.record_now(time.monotonic() - deadline, {telemetry.EXECUTION_NAME.name: name})
            except Exception:
                _fault()


def _observe_overdue(options: CallbackOptions) -> Iterable[Observation]:
    counts = dict.fromkeys(list(_names), 0)  # 0 once a name's work is no longer overdue: its state is over
    for _, _, name in list(OVERDUE.values()):
        counts[name] = counts.get(name, 0) + 1
    return [Observation(n, {telemetry.EXECUTION_NAME.name: name}) for name, n in counts.items()]


# ---- asyncio timeouts by call site --------------------------------------------------------------


def _site() -> dict[str, Any] | None:
    """`_call_site()`, or None (the fault counted) when it fails."""
    try:
        return _call_site()
    except Exception:
        _fault()
        return None


def _call_site() -> dict[str, Any]:
    """File and line of the host code that called the asyncio function (past wrapt and us)."""
    frame = sys._getframe(3)
    while frame.f_back is not None and (frame.f_code.co_filename == __file__ or "wrapt" in frame.f_code.co_filename):
        frame = frame.f_back
    return {"code.file.path": frame.f_code.co_filename, "code.line.number": frame.f_lineno}


def _count_expiry(function: str, site: dict[str, Any] | None) -> None:
    counter = _instruments.get(telemetry.ASYNCIO_TIMEOUTS.name)
    if counter is not None and site is not None:
        try:
            counter.add(1, {"code.function.name": function, **site})
        except Exception:
            _fault()


def _wait_for(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    site = _site()

    async def counting() -> Any:
        try:
            return await wrapped(*args, **kwargs)
        except asyncio.TimeoutError:
            _count_expiry("asyncio.wait_for", site)
            raise

    return counting()


def _wait(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    site = _site()
    timeout = kwargs.get("timeout", args[1] if len(args) > 1 else None)
    return_when = kwargs.get("return_when", args[2] if len(args) > 2 else asyncio.ALL_COMPLETED)

    async def counting() -> Any:
        result = await wrapped(*args, **kwargs)
        try:
            done, pending = result
            if timeout is not None and pending and (not done or return_when == asyncio.ALL_COMPLETED):
                _count_expiry("asyncio.wait", site)
        except Exception:
            _fault()
        return result

    return counting()


def _timeout(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    manager = wrapped(*args, **kwargs)
    site = _site()
    if site is not None:
        try:
            manager._stallwatch_site = site
        except Exception:
            _fault()
    return manager


async def _timeout_exit(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return await wrapped(*args, **kwargs)
    except TimeoutError:
        site = getattr(instance, "_stallwatch_site", None)
        if site is not None:
            _count_expiry("asyncio.timeout", site)
        raise


def install(meter_: Any) -> None:
    """Create the execution-timeout instruments and count asyncio timeouts by call site."""
    for metric in (telemetry.EXECUTION_TIMEOUTS, telemetry.ASYNCIO_TIMEOUTS):
        _instruments[metric.name] = instrument(meter_, metric)
    overrun = Deferred(meter_, telemetry.EXECUTION_OVERRUN_DURATION, owner=(COMPONENT, SETTING))
    _instruments[telemetry.EXECUTION_OVERRUN_DURATION.name] = overrun
    _names.clear()
    instrument(meter_, telemetry.EXECUTION_OVERDUE, _observe_overdue)
    wrapt.wrap_function_wrapper(asyncio, "wait_for", _wait_for)
    wrapt.wrap_function_wrapper(asyncio, "wait", _wait)
    if hasattr(asyncio, "timeouts"):  # Python 3.11+
        wrapt.wrap_function_wrapper(asyncio, "timeout", _timeout)
        wrapt.wrap_function_wrapper(asyncio.timeouts.Timeout, "__aexit__", _timeout_exit)


def uninstall() -> None:
    from opentelemetry.instrumentation.utils import unwrap

    unwrap(asyncio, "wait_for")
    unwrap(asyncio, "wait")
    if hasattr(asyncio, "timeouts"):
        unwrap(asyncio, "timeout")
        unwrap(asyncio.timeouts.Timeout, "__aexit__")
    _instruments.clear()
    _names.clear()
