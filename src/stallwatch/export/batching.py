"""One thread, `stallwatch-export`, exports every signal of a process: span and log record batches,
and the periodic metric collection (docs/footprint.md).

Each signal is a `Lane` (a bounded queue and its exporter, or a metric reader) queued and timed as
the SDK's processors and reader would be (`OTEL_BSP_*`, `OTEL_BLRP_*`, `OTEL_METRIC_EXPORT_INTERVAL`).
No host thread and no heartbeat ever waits on an export; once every export thread has spent
`SPARE_AFTER` seconds in one export while another lane waits, the heartbeat's thread starts a spare
(`watch`), which leaves once no other thread is held; never more threads than lanes.

Contract: exports run with instrumentation suppressed, one thread at a time per lane (its `turn`;
`flush()` takes it on the calling thread). Fork-aware: a child inherits the lanes with their queues
emptied and no thread, which starts on first use (`forksafe.guard.restart_pending`), never in an
after-fork handler; at interpreter exit, where none may start, the shutdown flushes on its own thread.
A child of a fork where no handler ran (C code forking without `PyOS_AfterFork_Child`; one the guard marked
exec-bound) gets the same at its first `BatchLane.add`, which compares pids: the queues emptied, the locks new.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader

from ..config import Batching
from ..core import background
from ..forksafe import guard, otel_compat

_log = logging.getLogger("stallwatch")
_SDK_METRIC_EXPORT_TIMEOUT_MS = 30_000  # the stock reader's default (`OTEL_METRIC_EXPORT_TIMEOUT`)
SPARE_AFTER = 0.25  # seconds every export thread has spent in one export before a waiting lane gets a spare
WATCH_SECONDS = 0.1  # how often the heartbeat's thread looks for that (`watch`)


class Lane:
    """What an export thread runs for one signal: `drain()` every `seconds`, and as soon as `ready()`."""

    seconds: float
    due: float
    turn: threading.Lock  # held by the one thread running the lane
    pid: int  # the process the lane's queue and lock belong to

    def ready(self) -> bool:
        """True when the lane should not wait for `due` (a full batch)."""
        return False

    def waiting(self, now: float) -> bool:
        """Due or ready, and no thread runs it now."""
        return (self.due <= now or self.ready()) and not self.turn.locked()

    def drain(self, everything: bool) -> None:
        """Export what is due (everything at `due`, else only full batches); the caller holds `turn`."""
        raise NotImplementedError

    def flush(self) -> bool:
        """Export everything now, on this thread; True (a lane has no other outcome to report)."""
        with self.turn:
            self.drain(everything=True)
        return True

    def adopt(self) -> None:
        """Take the lane over in a fork child: the parent's lock (and queue) are not the child's."""
        if self.pid != os.getpid():
            self.turn = threading.Lock()
            self.pid = os.getpid()


class BatchLane(Lane):
    """A bounded queue of spans or log records and the exporter that takes them in batches."""

    def __init__(self, signal: str, exporter: Any, batching: Batching) -> None:
        self.signal = signal
        self.exporter = exporter
        self.queue: deque[Any] = deque(maxlen=batching.queue)  # a full queue drops its oldest item
        self.batch = batching.batch
        self.seconds = batching.delay_seconds
        self.due = time.monotonic() + self.seconds
        self.pid = os.getpid()
        self.turn = threading.Lock()

    def add(self, item: Any) -> None:
        """Queue `item` for export; an export thread is woken when a batch is full."""
        if self.pid != os.getpid():
            EXPORTS.first_use_in_child()
        queue = self.queue
        queue.append(item)
        if len(queue) >= self.batch:
            EXPORTS.wake()

    def ready(self) -> bool:
        return len(self.queue) >= self.batch

    def drain(self, everything: bool) -> None:
        # footprint: the module loads the propagators; only an export needs it, on the export thread
        from opentelemetry.instrumentation.utils import suppress_instrumentation

        queue = self.queue
        with suppress_instrumentation():  # an instrumented HTTP client must not trace the exporter
            while queue and (everything or len(queue) >= self.batch):
                batch = [queue.popleft() for _ in range(min(self.batch, len(queue)))]
                try:
                    self.exporter.export(batch)
                except Exception:  # as the SDK's batch worker: log, and go on with the next batch
                    _log.exception("stallwatch: exporting %d %s failed", len(batch), self.signal)

    def shutdown(self) -> None:
        """Leave the export threads, export what is queued, then shut the exporter down."""
        EXPORTS.remove(self)
        self.flush()
        self.exporter.shutdown()

    def adopt(self) -> None:
        if self.pid != os.getpid():
            self.queue.clear()
            super().adopt()


class MetricLane(Lane):
    """The periodic collection of a `SharedThreadMetricReader`."""

    def __init__(self, reader: PeriodicExportingMetricReader, seconds: float) -> None:
        self.reader = reader
        self.seconds = seconds
        self.due = time.monotonic() + seconds
        self.turn = threading.Lock()
        self.pid = os.getpid()
        try:
            self.timeout_millis = float(os.environ.get("OTEL_METRIC_EXPORT_TIMEOUT", _SDK_METRIC_EXPORT_TIMEOUT_MS))
        except ValueError:
            self.timeout_millis = _SDK_METRIC_EXPORT_TIMEOUT_MS

    def drain(self, everything: bool) -> None:
        self.reader.collect(timeout_millis=self.timeout_millis)  # exports, under the reader's own lock

    def adopt(self) -> None:
        if self.pid != os.getpid():
            otel_compat.renew_metric_reader(self.reader)  # held by the parent's export thread, if it exported
            super().adopt()


class SharedThreadMetricReader(PeriodicExportingMetricReader):
    """The stock periodic reader without its thread: an export thread collects every
    `export_interval_millis`, and `shutdown()` collects once more first, as the stock thread does."""

    def __init__(self, exporter: MetricExporter, export_interval_millis: float) -> None:
        super().__init__(exporter, export_interval_millis=math.inf)  # math.inf: the stock reader starts no thread
        self.lane = MetricLane(self, export_interval_millis / 1000)
        EXPORTS.add(self.lane)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        if self.lane.pid != os.getpid():  # a fork child whose handlers did not run: its first flush adopts the lanes
            EXPORTS.first_use_in_child()
        return super().force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if EXPORTS.remove(self.lane):
            try:
                with self.lane.turn:
                    self.collect(timeout_millis=min(timeout_millis, self.lane.timeout_millis))
            except Exception:  # a timed-out or failed last collection must not keep the exporter open
                _log.warning("stallwatch: the last metric collection failed", exc_info=True)
        super().shutdown(timeout_millis=timeout_millis, **kwargs)


class _Runner:
    """One export thread's state, read by `watch`: since when it has been in one export (0: not)."""

    busy_since = 0.0


class _Exports:
    """The lanes of this process and the threads that run them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._lanes: list[Lane] = []
        self._runners: list[_Runner] = []
        self._thread_pid = 0  # the process the first export thread runs in
        self._pid = os.getpid()  # the process these locks are of (`_renew`)
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _renew(self) -> None:
        """New locks and no runner in a fork child: the parent's threads, not forked, may have held them."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._runners = []
        self._pid = os.getpid()

    def add(self, lane: Lane) -> None:
        """Give `lane` its turns on the export threads, started now if this process has none."""
        with self._lock:
            self._lanes.append(lane)
        self.ensure()
        self.wake()

    def remove(self, lane: Lane) -> bool:
        """Take `lane` off the threads (a turn in progress finishes); False if it was not on them."""
        with self._lock:
            if lane not in self._lanes:
                return False
            self._lanes.remove(lane)
            return True

    def wake(self) -> None:
        self._wake.set()

    def lanes(self) -> list[Lane]:
        with self._lock:
            return list(self._lanes)

    def ensure(self) -> bool:
        """Start the export thread in this process if it has none, and the heartbeat thread's `watch`;
        False when no thread may start (interpreter exit)."""
        pid = os.getpid()
        if self._thread_pid == pid:
            return True
        with self._lock:
            if self._thread_pid == pid:
                return True
            self._thread_pid = pid  # before the start: the thread runs while this is its process
            if not self._start(pid, primary=True):
                self._thread_pid = 0
                return False
        background.every(WATCH_SECONDS, self.watch)
        return True

    def watch(self) -> None:
        """On the heartbeat's thread: start a spare export thread when every one is held by a long
        export while a lane waits. Short and never blocking, as a heartbeat task must be."""
        now = time.monotonic()
        with self._lock:
            runners, lanes = list(self._runners), list(self._lanes)
            if not runners or len(runners) >= len(lanes):
                return
            if any(not runner.busy_since or now - runner.busy_since < SPARE_AFTER for runner in runners):
                return
            if any(lane.waiting(now) for lane in lanes):
                self._start(os.getpid(), primary=False)

    def _held(self, besides: _Runner) -> bool:
        """Whether an export thread other than `besides` has spent `SPARE_AFTER` seconds in one export."""
        now = time.monotonic()
        with self._lock:
            return any(r is not besides and r.busy_since and now - r.busy_since >= SPARE_AFTER for r in self._runners)

    def first_use_in_child(self) -> None:
        """Telemetry made in a fork child: the lanes become the child's and every deferred worker
        restarts (ours among them, unless the interpreter is exiting: the shutdown then flushes)."""
        if self._pid != os.getpid():  # our handler did not run (C code's fork, or skipped as exec-bound)
            self._renew()
        for lane in self.lanes():
            lane.adopt()
        guard.restart_pending()
        # Also where no handler ran, so nothing was deferred; never in a child about to exec (a `preexec_fn`
        # that logs), which does no work at all: what it queued and did not flush goes with the exec.
        if not guard.STATE.exiting and not guard.STATE.child_exec_bound:
            self.ensure()

    def _restart(self) -> None:
        for lane in self.lanes():
            lane.adopt()
        self.ensure()

    def _drain(self) -> None:
        for lane in self.lanes():
            lane.adopt()
            lane.flush()

    def _after_fork_in_child(self) -> None:
        """The parent's threads may have held the locks: new ones; the thread starts on first use."""
        if guard.STATE.child_exec_bound:
            return  # a child about to exec does no work at all
        self._renew()
        for lane in self._lanes:
            if isinstance(lane, BatchLane):
                lane.queue.clear()
            elif isinstance(lane, MetricLane):  # a metric export of the parent's thread may have held its lock
                lane.adopt()  # now, once: its pid, unlike a span lane's, tells no first use apart
        if self._lanes:
            guard.defer(self, _Exports._restart, _Exports._drain)

    def _start(self, pid: int, primary: bool) -> bool:
        """Start an export thread (the caller holds `_lock`); False when none may start."""
        runner = _Runner()
        name = "stallwatch-export" if primary else "stallwatch-export-spare"
        try:
            threading.Thread(target=self._work, args=(pid, runner, primary), name=name, daemon=True).start()
        except RuntimeError:
            return False
        self._runners.append(runner)
        return True

    def _work(self, pid: int, runner: _Runner, primary: bool) -> None:
        try:
            while self._thread_pid == pid == os.getpid():
                self._wake.clear()
                lanes = self.lanes()
                ran = False
                for lane in lanes:
                    now = time.monotonic()
                    if not lane.waiting(now) or not lane.turn.acquire(blocking=False):
                        continue
                    ran = True
                    try:
                        everything = lane.due <= now
                        if everything:
                            lane.due = now + lane.seconds
                        runner.busy_since = now
                        lane.drain(everything)
                    except Exception:  # a lane's own errors are its to log; this keeps the others running
                        _log.debug("stallwatch: export lane %r failed", lane, exc_info=True)
                    finally:
                        runner.busy_since = 0.0
                        lane.turn.release()
                if not primary and not ran and not self._held(runner):
                    return  # a spare leaves once nothing waits for it and no other export thread is held
                # A lane another thread runs is not waited for: its runner looks again when done.
                next_due = min((lane.due for lane in lanes if not lane.turn.locked()), default=None)
                timeout = None if next_due is None else max(0.0, next_due - time.monotonic())
                self._wake.wait(timeout if primary else min(timeout or WATCH_SECONDS, WATCH_SECONDS))
        finally:
            with self._lock:
                if runner in self._runners:
                    self._runners.remove(runner)


EXPORTS = _Exports()
