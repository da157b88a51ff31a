"""The executor story's record: what stallwatch knows about one work item and one pool.

`ItemRecord` is a `concurrent.futures.thread._WorkItem`: the item is its own record, no second
object per submission (`worker.WorkItem`, the class `submit` makes while the instrumentation is
on, adds the run). `ExecutorState` is a pool's accounting, reachable as `executor._stallwatch`.
`interrupt`, `timeout` and `detect.wedge` read these; nothing here imports them.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import thread as cf_thread
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Span

from .. import telemetry
from ..core.faults import Deferred
from ..core.scrub import MAX_NAME_CHARS, scrub_text

SETTING = "STALLWATCH_INSTRUMENT_EXECUTOR"
# The queue and run duration histograms of the current instrumentation, in that order (empty while off).
DURATIONS: list[Deferred] = []
DURATIONS_LIMIT = 100_000  # durations waiting per pool for the next drain; past that they are dropped


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

    Set in the submitting thread by the accounting queue's `put`: `executor` (None: the item went
    to a pool built before `instrument()`, which is not accounted), `submitted`, `context`, `span`;
    then in the worker: `started`, `thread`, `entered`, `finished`; by the wedge check: `dequeued_seen`,
    `orphaned`; by `interrupt`: `interrupt`. Class attributes are the defaults: a field costs
    nothing until it is set. `submitted` and `started` are `time.monotonic_ns()` readings: a
    duration made from two of them is a whole number of ns, which the span encoders write fastest.
    """

    executor: ExecutorState | None = None
    submitted: int = 0
    context: otel_context.Context | None = None
    span: Span | None = None
    dequeued_seen: float | None = None  # when the wedge check first saw it handed out
    started: int | None = None
    thread: threading.Thread | None = None
    # The contextvars copy the item's function runs in (`asyncio.to_thread`), when its context was set in there
    entered: contextvars.Context | None = None
    finished: bool = False
    orphaned: bool = False
    interrupt: Any = None  # the pending scoped interruption, see `interrupt`


class ExecutorState:
    """Per-executor accounting, reachable as `executor._stallwatch`."""

    def __init__(self, name: str, executor_ref: weakref.ReferenceType[ThreadPoolExecutor]) -> None:
        self.name = name
        self.executor_ref = executor_ref
        self.in_flight: list[ItemRecord] = []
        self.deaths: list[tuple[threading.Thread, BaseException | None]] = []
        self.orphans: list[ItemRecord] = []  # orphaned items whose futures may not be done yet
        self.attributes = {telemetry.EXECUTOR_NAME.name: name}  # the metric attributes, built once
        self.span_name = f"{name} work item"
        # Where the queue and run durations of this pool's items wait for `drain_histograms()`.
        self.durations: tuple[list[float], list[float]] = ([], [])
        self.bind_histograms()

    def bind_histograms(self) -> None:
        """Append durations to the lists of the current instrumentation's histograms (if it is on)."""
        if DURATIONS:
            self.durations = (DURATIONS[0].values_for(self.attributes), DURATIONS[1].values_for(self.attributes))
