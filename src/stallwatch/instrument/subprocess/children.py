"""The record of each child process: what its span and metrics will say, from its spawn to its reaping.

A wrapper calls `begin` before the spawn, then `spawned` or `spawn_failed`, and a reaper calls `exited`:
the span is ended, in the reaping thread, before the host hears of the exit. Each child is ended exactly
once (`_claim`), by its reaper, its failed spawn or `end_open_spans` at shutdown, and measured exactly
once (`_Unmeasured`), by its reaper or a metric collection while it runs. A failure inside stallwatch is
counted and logged once, naming `STALLWATCH_INSTRUMENT_SUBPROCESS`.

A child killed by a signal is told apart by `child_fate`: whether it had exec'd (decided right after the
spawn call) and whether the host signalled it itself. Only a child that died before exec, by a signal the
host did not send, gets the `stallwatch.subprocess.early_signal` event (and one whose exec stallwatch
could not tell, within `EARLY_SIGNAL_SECONDS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from time import perf_counter, time_ns
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from ... import telemetry
from ...core import light_span, scrub
from ...core.faults import FAULTS, SPAWN_OBSERVER, Counts, Deferred, first_record, instrument, signal_name
from ...forksafe import guard
from ...forksafe.loop import loop_kind
from .. import child_fate
from .arguments import popen_command

_log = logging.getLogger("stallwatch")
COMPONENT = "subprocess"
SETTING = "STALLWATCH_INSTRUMENT_SUBPROCESS"
EARLY_SIGNAL_SECONDS = 1.0
"""A child killed this soon after its spawn by a signal the host did not send, whose exec stallwatch
could not tell, gets the `early_signal` event (see `child_fate`)."""


# The attribute keys, read once: the reaping thread runs with the caches cold, where each lookup costs.
_BLOCKED = telemetry.SPAWN_BLOCKED.name
_METHOD = telemetry.SPAWN_METHOD.name
_PID = telemetry.PROCESS_PID.name
_EXIT_CODE = telemetry.PROCESS_EXIT_CODE.name
_EXIT_SIGNAL = telemetry.EXIT_SIGNAL.name
_ERROR_TYPE = telemetry.ERROR_TYPE.name
_SIGNALLED_BY_HOST = telemetry.SIGNALLED_BY_HOST.name


class Child:
    """One spawned child: what its span will say, gathered from the spawn call until it is reaped.

    The spawning thread only takes the clock, the parent context and references: to the call's
    arguments and the running loop before the spawn (`begin`), the pid and the blocked time after
    it (`spawned`). Right after a spawn every instruction runs with the caches cold, so the
    executable name, the attributes, the spawn's metric (`_measure`) and the span (`_build`) wait
    for the exit: the reaping thread does them in `exited`, before `wait()`, `poll()`,
    `communicate()`, `run()`, a wait function or the loop's `process_exited` returns, so the span
    is ended by the time the host sees the exit. A child still running when metrics are collected is measured then
    (`_Unmeasured.measure_all`), for its spawn's duration and its `active` series.
    """

    __slots__ = (
        "attributes", "blocked", "command", "done", "end_ns", "error", "exit_before_spawned", "fate", "lived", "loop",
        "measured", "method", "name", "observer", "parent", "pid", "popen_args", "returncode", "span", "spawned",
        "start_ns", "started", "tracer",
    )  # fmt: skip

    def __init__(self, tracer: trace.Tracer, loop: str | asyncio.AbstractEventLoop | None, method: str) -> None:
        self.tracer = tracer  # the span is built with it even if the instrumentor is turned off meanwhile
        self.loop = loop  # its kind (`uvloop`, `asyncio`, `none`) once measured
        self.method = method  # `posix_spawn` once a Popen's spawn says so
        self.command: tuple[object, Sequence[object]] | None = None  # (program, argv) until described
        self.popen_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # a Popen's arguments, likewise
        self.parent = context_api.get_current()
        self.start_ns = time_ns()
        self.started = perf_counter()
        self.name = "?"
        self.attributes: dict[str, Any] = {}
        self.end_ns = 0
        self.lived = 0.0
        self.returncode: int | None = None
        self.span: trace.Span | None = None  # built eagerly only when TRACEPARENT must reach the child
        self.error: BaseException | None = None
        self.blocked = 0.0
        self.pid: int | None = None
        self.spawned = False
        self.done = False
        self.measured = False
        self.exit_before_spawned: int | None = None
        self.fate: child_fate.Fate | None = None  # whether it exec'd, from right after the spawn call
        self.observer = SPAWN_OBSERVER.get()


class State:
    """What one `instrument()` made: the tracer, the instruments and the settings the wrappers read."""

    def __init__(
        self,
        *,
        tracer: trace.Tracer,
        spawn_duration: Deferred,
        exits: Counts,
        active: Any,  # the observable instrument that reads `_open`
        record_args: bool,
        patterns: tuple[Any, ...],
        propagate: bool,
    ) -> None:
        self.tracer = tracer
        self.spawn_duration = spawn_duration
        self.exits = exits
        self.active = active
        self.record_args = record_args
        self.patterns = patterns
        self.propagate = propagate


ACTIVE: State | None = None
"""The instrumentor's state while it is on, else None. A module global because the wrappers are module
functions that wrapt puts on shared classes and functions (`Popen`, `os`, the loops): one read per call."""
# id(child) -> child, to end the spans of children still running at shutdown: process-wide, as a child
# outlives an instrument/uninstrument cycle. No lock: every use is one dict operation (atomic under the GIL).
_open: dict[int, Child] = {}
IN_LOOP_SPAWN: contextvars.ContextVar[Child | None] = contextvars.ContextVar("stallwatch_loop_spawn", default=None)
IN_POPEN: contextvars.ContextVar[Child | None] = contextvars.ContextVar("stallwatch_popen", default=None)
UNRECORDED = contextvars.ContextVar("stallwatch_unrecorded_spawn", default=False)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Spawns made inside are not recorded: stallwatch's own (a forked worker's watchdog), which
    would otherwise count as a child of the host's for as long as it runs, and its end as a kill."""
    token = UNRECORDED.set(True)
    try:
        yield
    finally:
        UNRECORDED.reset(token)


def fault() -> None:
    FAULTS.record(COMPONENT, SETTING)


def safely(function: Callable[..., object], *args: Any) -> None:
    try:
        function(*args)
    except Exception:
        fault()


# ---- measuring and building, when the child is reaped ----------------------------------------------


class _Unmeasured:
    """Children spawned and not measured yet (`_measure`), each measured exactly once: by the thread
    that reaps it, or by a metric collection while it runs (`measure_all`), whichever comes first.
    The map holds only children still running; reaping takes a child out."""

    def __init__(self) -> None:
        self.children: dict[int, Child] = {}  # id(child) -> child: one dict operation each, atomic under the GIL
        self._lock = threading.Lock()  # taken around a collection's measuring: a reaper waits for it
        self._pid = os.getpid()

    def lock(self) -> threading.Lock:
        if self._pid != os.getpid():  # a fork child: a parent's thread may have held it
            self._pid, self._lock = os.getpid(), threading.Lock()
        return self._lock

    def measure(self, child: Child) -> None:
        """Measure `child` now unless that is done or under way (then wait for it).

        The one caller that takes the child out of the map measures it (one dict operation, atomic
        under the GIL); a collection takes it out and measures it under the lock, so a reaper that
        finds it gone and not measured waits for that lock."""
        if self.children.pop(id(child), None) is not None:
            _measure(child)
        elif not child.measured:
            with self.lock():
                pass

    def measure_all(self) -> None:
        """Measure every child spawned and not reaped yet (before a collection: durations and names)."""
        children = self.children
        while children:
            with self.lock():
                try:
                    child = children.popitem()[1]
                except KeyError:
                    return
                safely(_measure, child)


_UNMEASURED = _Unmeasured()


def _measure(child: Child) -> None:
    """A spawned (or failed) child: its name and attributes, and the spawn's duration metric."""
    state = ACTIVE
    _describe(child, state)
    attributes = child.attributes
    if child.spawned or child.error is not None:
        attributes[_BLOCKED] = child.blocked
        attributes[_METHOD] = child.method
        if child.pid is not None:
            attributes[_PID] = child.pid
        if state is not None:
            state.spawn_duration.record(child.blocked, _duration_attributes(child))
    _spawned_names.add(child.name)
    child.measured = True


def _end(child: Child) -> None:
    """The child is over (reaped, failed to spawn, or still running at shutdown): measure it if no
    collection did, then build and end its span (named "?" if measuring failed). Runs once per
    child (see `_claim`)."""
    try:
        if child.spawned:
            _UNMEASURED.measure(child)
        else:  # a failed spawn was never offered to a collection
            _measure(child)
    except Exception:
        fault()
    try:
        _build(child)
    except Exception:
        fault()


def _build(child: Child) -> None:
    fate = child.fate
    if fate is not None:
        child_fate.annotate(fate, child.attributes, child.end_ns)
    _exit_attributes(child)
    returncode = child.returncode
    span = child.span
    if span is None and child.error is None and (returncode is None or returncode >= 0) and not (fate and fate.signals):
        # No event and no span yet (the usual exit): the span is built ended, and handed on.
        status = Status(StatusCode.ERROR, f"exit code {returncode}") if returncode else None
        light_span.finish(child.tracer, child.name, child.parent, SpanKind.CLIENT, child.start_ns, child.end_ns,
                          child.attributes, status)  # fmt: skip
        return
    if span is None:
        span = light_span.start(child.tracer, child.name, child.parent, {}, SpanKind.CLIENT, child.start_ns, shed=True)
    if isinstance(span, light_span.LightSpan):
        span.set_own_attributes(child.attributes)  # built by this module: valid and bounded
    else:
        span.set_attributes(child.attributes)
    child_fate.add_events(span, fate, child.start_ns, child.end_ns, returncode, child.lived, EARLY_SIGNAL_SECONDS)
    if child.error is not None:
        span.record_exception(child.error, timestamp=child.end_ns)
        span.set_status(Status(StatusCode.ERROR, f"spawn failed: {type(child.error).__qualname__}"))
    elif returncode is not None and returncode < 0:
        span.set_status(Status(StatusCode.ERROR, child_fate.killed_by(returncode, fate, child.end_ns)))
    elif returncode:
        span.set_status(Status(StatusCode.ERROR, f"exit code {returncode}"))
    span.end(end_time=child.end_ns)


def _exit_attributes(child: Child) -> None:
    """The exit's attributes and count, from the return code `exited` stamped."""
    returncode = child.returncode
    if returncode is None:
        return
    attributes = child.attributes
    attributes[_EXIT_CODE] = returncode
    signal = None
    if returncode < 0:
        signal = signal_name(-returncode)
        attributes[_EXIT_SIGNAL] = attributes[_ERROR_TYPE] = signal
    elif returncode:
        attributes[_ERROR_TYPE] = str(returncode)
    state = ACTIVE
    if state is not None:
        host = attributes.get(_SIGNALLED_BY_HOST)
        state.exits.add(1, child.name, "signal" if signal else "code", signal, host)


class SpawnDurations(Deferred):
    """`stallwatch.subprocess.spawn.duration`: each collection (whichever way it drains the values)
    first measures the children still running, so no spawn's value is a collection late."""

    def drain(self) -> None:
        _UNMEASURED.measure_all()
        super().drain()


def forget_all() -> None:
    """Forget every child (in a fork child, whose parent's children are the parent's to report)."""
    _open.clear()
    _UNMEASURED.children.clear()


# ---- the child's life: begin, spawned, exited ----------------------------------------------------


def begin(state: State, loop: str | asyncio.AbstractEventLoop | None, method: str) -> Child:
    """Before the spawn: the clock and the parent context (the caller sets `command` or `popen_args`)."""
    child = Child(state.tracer, loop, method)
    _open[id(child)] = child
    return child


def start_span_now(state: State, child: Child, program: object) -> None:
    """With propagation on, the span starts before the spawn: its context goes into TRACEPARENT."""
    child.name = scrub.executable_name(program)
    first_record()
    child.span = state.tracer.start_span(
        child.name, context=child.parent, kind=SpanKind.CLIENT, start_time=child.start_ns
    )


def describe(program: object, argv: Sequence[object], loop: str, record_args: bool,
             patterns: Sequence[Any] = ()) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """The executable name and the span attributes of a spawn of `argv` (scrubbed, bounded)."""
    name = scrub.executable_name(program)
    attributes: dict[str, Any] = {
        telemetry.PROCESS_EXECUTABLE_NAME.name: name,
        telemetry.PROCESS_ARGS_COUNT.name: scrub.args_count(argv),
        telemetry.SPAWN_LOOP.name: loop,
        telemetry.GRPC_ACTIVE.name: guard.grpc_active(),
    }
    if record_args:
        attributes[telemetry.PROCESS_COMMAND_ARGS.name] = scrub.scrub_args(argv, patterns)
    return name, attributes


def _describe(child: Child, state: State | None) -> None:
    """Fill in the child's name, attributes and loop kind from the references the calling
    thread kept, then drop them (the host's argument lists are not held for the child's life)."""
    command, popen_args = child.command, child.popen_args
    child.command = child.popen_args = None
    if command is None:
        command = popen_command(*popen_args) if popen_args is not None else ("?", ())
    if not isinstance(child.loop, str):
        child.loop = loop_kind(child.loop)
    record_args = state is not None and state.record_args
    child.name, attributes = describe(command[0], command[1], child.loop, record_args,
                                      state.patterns if state is not None else ())  # fmt: skip
    child.attributes.update(attributes)


_DURATION_KEYS: dict[tuple[str, str, str], dict[str, Any]] = {}  # attribute dicts, reused (bounded below)


def _duration_attributes(child: Child) -> dict[str, Any]:
    key = (child.name, str(child.loop), child.method)
    attributes = _DURATION_KEYS.get(key)
    if attributes is None:
        attributes = {
            telemetry.PROCESS_EXECUTABLE_NAME.name: key[0],
            telemetry.SPAWN_LOOP.name: key[1],
            telemetry.SPAWN_METHOD.name: key[2],
        }
        if len(_DURATION_KEYS) < 1024:
            _DURATION_KEYS[key] = attributes
    return attributes


def spawned(child: Child, pid: int, blocked: float) -> None:
    """Right after the spawn call returned: the facts; the rest waits for the exit (see `Child`)."""
    child.pid = pid
    child.blocked = blocked
    child.spawned = True
    if child.fate is None:
        child.fate = child_fate.exec_seen(pid, forked=child.method == "fork")
    child_fate.watch(child.fate)
    if not child.done:  # not ended meanwhile by the shutdown
        _UNMEASURED.children[id(child)] = child
    if child.exit_before_spawned is not None:
        exited(child, child.exit_before_spawned)


def spawn_failed(child: Child, error: BaseException, blocked: float) -> None:
    """The spawn call raised: the span ends now, before the error reaches the host."""
    if not _claim(child):
        return
    child.attributes[telemetry.ERROR_TYPE.name] = type(error).__qualname__
    child.blocked = blocked
    child.error = error
    child.end_ns = time_ns()
    _end(child)


def exited(child: Child, returncode: int) -> None:
    """The child was reaped: its span ends now, in the reaping thread, before the host hears of the exit."""
    if not child.spawned:  # the loop reported the exit before the spawn call returned
        child.exit_before_spawned = returncode
        return
    if not _claim(child):  # ended at shutdown, or reported twice
        return
    child.end_ns = time_ns()
    child.lived = perf_counter() - child.started
    child.returncode = returncode
    _end(child)
    if child.observer is not None:
        child.observer(returncode)


def _claim(child: Child) -> bool:
    """Take the child out of `_open`: True for the one caller that ends it (its reaper, its failed
    spawn or the shutdown; one dict operation, atomic under the GIL)."""
    claimed = _open.pop(id(child), None) is not None
    child.done = True
    if claimed and child.fate is not None:
        child_fate.forget(child.fate)
    return claimed


_spawned_names: set[str] = set()  # every executable name measured in this process: its `active` series


class Active:
    """`stallwatch.subprocess.active`, read from `_open` when collected: children spawned and not
    reaped, per executable name (0 for a name spawned before, so its series goes back to 0)."""

    def __init__(self, meter_: Any, before: Callable[[], None]) -> None:
        self._before = before
        self.instrument = instrument(meter_, telemetry.SUBPROCESS_ACTIVE, self._observe)

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        self._before()  # measures the children still running: every child spawned so far has its name
        counts = dict.fromkeys(list(_spawned_names), 0)
        for child in list(_open.values()):
            if child.measured and child.spawned and not child.done:
                counts[child.name] = counts.get(child.name, 0) + 1
        key = telemetry.PROCESS_EXECUTABLE_NAME.name
        return [Observation(count, {key: name}) for name, count in counts.items()]


def end_open_spans() -> int:
    """End the spans of children still running, marked so (called at shutdown).

    Returns how many children were still running.
    """
    ended = 0
    now = time_ns()
    while _open:
        try:
            child = _open.popitem()[1]  # one at a time: a child added meanwhile is not lost
        except KeyError:
            break
        child.done = True
        child.attributes[telemetry.RUNNING_AT_SHUTDOWN.name] = True
        child.end_ns = now
        _end(child)
        ended += 1
    return ended


def environment_with_context(env: Mapping[Any, Any] | None, child: Child) -> dict[Any, Any]:
    """A copy of `env` (default `os.environ`) with the child span's W3C context as `TRACEPARENT`..."""
    # footprint: loading the propagators reads OTEL_PROPAGATORS' entry points; only a propagating spawn needs them
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    if child.span is not None:
        propagate.inject(carrier, context=trace.set_span_in_context(child.span))
    base = dict(os.environ if env is None else env)
    as_bytes = bool(base) and all(isinstance(key, bytes) for key in base)
    for key, value in carrier.items():
        name = key.upper().replace("-", "_")
        if as_bytes:
            base[os.fsencode(name)] = os.fsencode(value)
        else:
            base[name] = value
    return base
