"""The background thread of stallwatch's that never waits (`stallwatch-worker`).

It runs the periodic tasks of the freeze heartbeat (`detect.heartbeat`), of the wedge detector
(`detect.wedge`) and of the export threads' watch (`export.batching`), and the telemetry pipeline's
shutdown when asked (`pipeline`). Exports have a thread of their own (`export.batching`): one may
wait for a collector, which a heartbeat cannot.

Contract: fork-aware like the SDK's workers: a task belongs to the process that added it, and the
thread starts on first need in each process, never in an after-fork handler. Tasks must be short
and never block: they share the thread with the heartbeat, whose lateness is a freeze to the
watchdog. A job (the shutdown) may take its time: the heartbeat has stopped before it is asked for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

_log = logging.getLogger("stallwatch")
IDLE_SECONDS = 1.0  # how long the thread sleeps when no task is due sooner (a job wakes it at once)


class Task:
    """A periodic task: `run()` every `seconds`, in process `pid` only."""

    def __init__(self, run: Callable[[], None], seconds: float, due: float = 0.0) -> None:
        self.run = run
        self.seconds = seconds
        self.pid = os.getpid()
        self.due = due


class Job:
    """A one-off job; `done` is set once it has run (whatever it raised)."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.done = threading.Event()


_lock = threading.Lock()
_tasks: list[Task] = []
_jobs: deque[Job] = deque()
_wake = threading.Event()
_thread_pid = 0


def _after_fork_in_child() -> None:
    """The parent's thread may have held the lock or the event's lock at the fork: new ones (no
    thread starts here; the child's starts on first need)."""
    global _lock, _wake
    _lock = threading.Lock()
    _wake = threading.Event()


os.register_at_fork(after_in_child=_after_fork_in_child)


def every(seconds: float, run: Callable[[], None]) -> Task:
    """Run `run()` every `seconds` on the worker of this process, the first time at once; returns
    the task for `cancel()`. `run` handles its own errors: one that escapes is logged at DEBUG."""
    task = Task(run, seconds, due=time.monotonic())
    with _lock:
        _tasks.append(task)
    ensure()
    _wake.set()
    return task


def cancel(task: Task) -> None:
    """Stop running `task` (at most the run in progress finishes)."""
    with _lock:
        if task in _tasks:
            _tasks.remove(task)


def ensure() -> bool:
    """Start the worker in this process if it has none; False when no thread can start (Python
    3.12+ at interpreter exit)."""
    global _thread_pid
    pid = os.getpid()
    if _thread_pid == pid:
        return True
    with _lock:
        if _thread_pid == pid:
            return True
        try:
            threading.Thread(target=_work, args=(pid,), name="stallwatch-worker", daemon=True).start()
        except RuntimeError:
            return False
        _thread_pid = pid
        return True


def submit(run: Callable[[], None]) -> Job | None:
    """Run `run()` on the worker as soon as the task running now (if any) has finished; None when
    this process has no worker and can start none (then run it yourself)."""
    if not ensure():
        return None
    job = Job(run)
    _jobs.append(job)
    _wake.set()
    return job


def _work(pid: int) -> None:
    while os.getpid() == pid:
        now = time.monotonic()
        with _lock:
            mine = [task for task in _tasks if task.pid == pid]
        for task in mine:
            if task.due <= now:
                task.due = now + task.seconds
                try:
                    task.run()
                except Exception:  # a task's own errors are its to count; this only keeps the others running
                    _log.debug("stallwatch: background task %r failed", task.run, exc_info=True)
        while _jobs:
            job = _jobs.popleft()
            try:
                job.run()
            except Exception:
                _log.debug("stallwatch: background job %r failed", job.run, exc_info=True)
            finally:
                job.done.set()
        next_due = min((task.due for task in mine), default=now + IDLE_SECONDS)
        _wake.wait(max(0.0, min(next_due, now + IDLE_SECONDS) - time.monotonic()))
        _wake.clear()
