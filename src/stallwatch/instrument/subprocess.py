"""Subprocess instrumentation: one CLIENT span and three metrics per child process.

Every path a server spawns through is covered once:

- `subprocess.Popen.__init__` (so `run`, `call`, `check_output`); the child's span ends in
  `Popen._handle_exitstatus`, where `wait()`/`poll()` reap it;
- a loop's `subprocess_exec`/`subprocess_shell`, on the standard loop (`BaseEventLoop`) and on
  uvloop (`uvloop.Loop`, which never calls `Popen`). `asyncio.create_subprocess_exec` and
  `asyncio.subprocess.create_subprocess_exec` are separate bindings, and both call these loop
  methods. The span ends when the loop calls the protocol's `process_exited`. On the standard
  loop the `Popen` underneath only tells the outer span how it spawned;
- `os.posix_spawn`/`os.posix_spawnp` called directly; their children are reaped through
  `os.waitpid`/`wait`/`wait3`/`wait4`, which the instrumentor checks against its own pids.

`os.fork()` is counted by the fork guard (`stallwatch.fork.count`), not spanned.

A child killed by a signal is told apart by `child_fate`: whether it had exec'd (decided right
after the spawn call, not from how soon it died) and whether the host signalled it itself. Only a
child that died before exec, by a signal the host did not send, gets the incident's
`stallwatch.subprocess.early_signal` event (and one whose exec stallwatch could not tell, within
`EARLY_SIGNAL_SECONDS`).

`stallwatch.spawn.blocked_seconds` is the time the calling thread spent inside the spawn call. For
a loop's coroutine it is the sum of the synchronous steps, not the time spent awaiting. Under
uvloop the fork and the wait for the child's exec happen in the first step, while uvloop holds
the GIL: this is the frozen time of incident 000.

No OpenTelemetry contrib package instruments subprocesses, so this one is written here. Every
wrapper hands the host the same result, exception, pid and pipes as the bare call. A failure
inside stallwatch is counted (`stallwatch.instrumentation.errors{stallwatch.component=subprocess}`)
and logged once, naming `STALLWATCH_INSTRUMENT_SUBPROCESS`.
"""

from __future__ import annotations

import asyncio.base_events
import asyncio.base_subprocess
import contextlib
import contextvars
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Collection, Coroutine, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter, time_ns
from typing import Any

import wrapt
from opentelemetry import context as context_api
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import telemetry
from .._version import __version__
from ..config import ConfigError, Settings
from ..core import light_span, scrub
from ..core.faults import (
    FAULTS,
    SPAWN_OBSERVER,
    Counts,
    Deferred,
    first_record,
    instrument,
    meter,
    signal_name,
    unwrap_method,
)
from ..forksafe import guard
from ..forksafe.loop import loop_kind
from . import child_fate
from ._lifecycle import ForkReset, ImportHooks

_log = logging.getLogger("stallwatch")
COMPONENT = "subprocess"
SETTING = "STALLWATCH_INSTRUMENT_SUBPROCESS"
EARLY_SIGNAL_SECONDS = 1.0
"""A child killed this soon after its spawn by a signal the host did not send, whose exec stallwatch
could not tell, gets the `early_signal` event (see `child_fate`)."""

_WAIT_FUNCTIONS = ("waitpid", "wait", "wait3", "wait4")
_POSIX_SPAWN_FUNCTIONS = ("posix_spawn", "posix_spawnp")
_LOOP_METHODS = ("subprocess_exec", "subprocess_shell")


class _Child:
    """One spawned child: what its span will say, gathered from the spawn call until it is reaped.

    The spawning thread only takes the clock, the parent context and references: to the call's
    arguments and the running loop before the spawn (`_begin`), the pid and the blocked time after
    it (`_spawned`). Right after a spawn every instruction runs with the caches cold (the measured
    cost of the same code is about four times its warm cost), so the executable name, the
    attributes and the spawn's metric (`_measure`) and the span (`_build`) wait for the exit: the
    reaping thread does them in `_exited`, before `wait()`, `poll()`, `communicate()`, `run()`, a
    wait function or the loop's `process_exited` returns, so the span is ended by the time the host
    sees the exit. A child still running when metrics are collected is measured then
    (`_Unmeasured.measure_all`), for its spawn's duration and its `active` series.
    """

    __slots__ = (
        "attributes", "blocked", "command", "done", "end_ns", "error", "exit_before_spawned", "fate", "lived", "loop",
        "measured", "method", "name", "observer", "parent", "pid", "popen_args", "returncode", "span", "spawned",
        "start_ns", "started", "tracer",
    )  # fmt: skip

    def __init__(self, tracer: trace.Tracer, loop: str | asyncio.AbstractEventLoop | None, method: str | None) -> None:
        self.tracer = tracer  # the span is built with it even if the instrumentor is turned off meanwhile
        self.loop = loop  # its kind (`uvloop`, `asyncio`, `none`) once measured
        self.method = method  # None: worked out from `popen_args` once the spawn is over
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


@dataclass
class _State:
    tracer: trace.Tracer
    spawn_duration: Deferred
    exits: Counts
    active: Any  # the observable instrument that reads `_open`
    record_args: bool
    patterns: tuple[Any, ...]
    propagate: bool


_state: _State | None = None
# id(child) -> child, to end the spans of children still running at shutdown. No lock: every use is
# one dict operation (atomic under the GIL); a lock here cost 1-3 µs per child with the caches cold
# from the spawn itself (measured).
_open: dict[int, _Child] = {}
_CHILD_ATTRIBUTE = "_stallwatch_child"  # on a Popen: its child from its spawn to its reaping, then None
_by_pid: dict[int, _Child] = {}  # children of direct os.posix_spawn calls, until a wait function reaps them
_in_loop_spawn: contextvars.ContextVar[_Child | None] = contextvars.ContextVar("stallwatch_loop_spawn", default=None)
_in_popen: contextvars.ContextVar[_Child | None] = contextvars.ContextVar("stallwatch_popen", default=None)
_unrecorded = contextvars.ContextVar("stallwatch_unrecorded_spawn", default=False)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Spawns made inside are not recorded: stallwatch's own (a forked worker's watchdog), which
    would otherwise count as a child of the host's for as long as it runs, and its end as a kill."""
    token = _unrecorded.set(True)
    try:
        yield
    finally:
        _unrecorded.reset(token)


def _fault() -> None:
    FAULTS.record(COMPONENT, SETTING)


# ---- measuring and building, when the child is reaped ----------------------------------------------


class _Unmeasured:
    """Children spawned and not measured yet (`_measure`), each measured exactly once: by the thread
    that reaps it, or by a metric collection while it runs (`measure_all`), whichever comes first.
    The map holds only children still running; reaping takes a child out."""

    def __init__(self) -> None:
        self.children: dict[int, _Child] = {}  # id(child) -> child: one dict operation each, atomic under the GIL
        self._lock = threading.Lock()  # taken around each measuring: a reaper waits for a collection's
        self._pid = os.getpid()

    def lock(self) -> threading.Lock:
        if self._pid != os.getpid():  # a fork child: a parent's thread may have held it
            self._pid, self._lock = os.getpid(), threading.Lock()
        return self._lock

    def measure(self, child: _Child) -> None:
        """Measure `child` now unless that is done or under way (then wait for it)."""
        with self.lock():
            if self.children.pop(id(child), None) is not None:
                _measure(child)

    def measure_all(self) -> None:
        """Measure every child spawned and not reaped yet (before a collection: durations and names)."""
        children = self.children
        while children:
            with self.lock():
                try:
                    child = children.popitem()[1]
                except KeyError:
                    return
                _safely(_measure, child)


_UNMEASURED = _Unmeasured()


def _measure(child: _Child) -> None:
    """A spawned (or failed) child: its name and attributes, and the spawn's duration metric."""
    state = _state
    _describe(child, state)
    attributes = child.attributes
    if child.spawned or child.error is not None:
        attributes[telemetry.SPAWN_BLOCKED.name] = child.blocked
        attributes[telemetry.SPAWN_METHOD.name] = child.method
        if child.pid is not None:
            attributes[telemetry.PROCESS_PID.name] = child.pid
        if state is not None:
            state.spawn_duration.record(child.blocked, _duration_attributes(child))
    _spawned_names.add(child.name)
    child.measured = True


def _end(child: _Child) -> None:
    """The child is over (reaped, failed to spawn, or still running at shutdown): measure it if no
    collection did, then build and end its span (named "?" if measuring failed). Runs once per
    child (see `_claim`)."""
    # A failed spawn was never offered to a collection.
    _safely(_UNMEASURED.measure if child.spawned else _measure, child)
    _safely(_build, child)


def _build(child: _Child) -> None:
    fate = child.fate
    if fate is not None:
        child_fate.annotate(fate, child.attributes, child.end_ns)
    _exit_attributes(child)
    span = child.span
    if span is None:
        span = light_span.start(child.tracer, child.name, child.parent, {}, SpanKind.CLIENT, child.start_ns, shed=True)
    if isinstance(span, light_span.LightSpan):
        span.set_own_attributes(child.attributes)  # built by this module: valid and bounded
    else:
        span.set_attributes(child.attributes)
    returncode = child.returncode
    child_fate.add_events(span, fate, child.start_ns, child.end_ns, returncode, child.lived, EARLY_SIGNAL_SECONDS)
    if child.error is not None:
        span.record_exception(child.error, timestamp=child.end_ns)
        span.set_status(Status(StatusCode.ERROR, f"spawn failed: {type(child.error).__qualname__}"))
    elif returncode is not None and returncode < 0:
        span.set_status(Status(StatusCode.ERROR, child_fate.killed_by(returncode, fate, child.end_ns)))
    elif returncode:
        span.set_status(Status(StatusCode.ERROR, f"exit code {returncode}"))
    span.end(end_time=child.end_ns)


def _exit_attributes(child: _Child) -> None:
    """The exit's attributes and count, from the return code `_exited` stamped."""
    returncode = child.returncode
    if returncode is None:
        return
    attributes = child.attributes
    attributes[telemetry.PROCESS_EXIT_CODE.name] = returncode
    signal = None
    if returncode < 0:
        signal = signal_name(-returncode)
        attributes[telemetry.EXIT_SIGNAL.name] = attributes[telemetry.ERROR_TYPE.name] = signal
    elif returncode:
        attributes[telemetry.ERROR_TYPE.name] = str(returncode)
    state = _state
    if state is not None:
        host = attributes.get(telemetry.SIGNALLED_BY_HOST.name)
        state.exits.add(1, child.name, "signal" if signal else "code", signal, host)


class _SpawnDurations(Deferred):
    """`stallwatch.subprocess.spawn.duration`: each collection (whichever way it drains the values)
    first measures the children still running, so no spawn's value is a collection late."""

    def drain(self) -> None:
        _UNMEASURED.measure_all()
        super().drain()


def _forget_the_parents_children() -> None:
    """In a fork child that lives on: the parent's children are the parent's to report; this
    process would otherwise end them again at its own shutdown."""
    _open.clear()
    _by_pid.clear()
    _UNMEASURED.children.clear()


_FORK_RESET = ForkReset(_forget_the_parents_children)  # starts nothing: clears three maps


# ---- the child's life: begin, spawned, exited ----------------------------------------------------


def _begin(state: _State, loop: str | asyncio.AbstractEventLoop | None, method: str | None) -> _Child:
    """Before the spawn: the clock and the parent context (the caller sets `command` or `popen_args`)."""
    child = _Child(state.tracer, loop, method)
    _open[id(child)] = child
    return child


def _start_span_now(state: _State, child: _Child, program: object) -> None:
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


def _describe(child: _Child, state: _State | None) -> None:
    """Fill in the child's name, attributes, loop kind and method from the references the calling
    thread kept, then drop them (the host's argument lists are not held for the child's life)."""
    command, popen_args = child.command, child.popen_args
    child.command = child.popen_args = None
    if command is None:
        command = _popen_command(*popen_args) if popen_args is not None else ("?", ())
    if child.method is None:
        child.method = popen_method(*popen_args) if popen_args is not None else "vfork"
    if not isinstance(child.loop, str):
        child.loop = loop_kind(child.loop)
    record_args = state is not None and state.record_args
    child.name, attributes = describe(command[0], command[1], child.loop, record_args,
                                      state.patterns if state is not None else ())  # fmt: skip
    child.attributes.update(attributes)


_DURATION_KEYS: dict[tuple[str, str, str], dict[str, Any]] = {}  # attribute dicts, reused (bounded below)


def _duration_attributes(child: _Child) -> dict[str, Any]:
    key = (child.name, str(child.loop), child.method or "?")
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


def _spawned(child: _Child, pid: int, blocked: float) -> None:
    """Right after the spawn call returned: the facts; the rest waits for the exit (see `_Child`)."""
    child.pid = pid
    child.blocked = blocked
    child.spawned = True
    if child.fate is None:
        child.fate = child_fate.exec_seen(pid)
    child_fate.watch(child.fate)
    if not child.done:  # not ended meanwhile by the shutdown
        _UNMEASURED.children[id(child)] = child
    if child.exit_before_spawned is not None:
        _exited(child, child.exit_before_spawned)


def _spawn_failed(child: _Child, error: BaseException, blocked: float) -> None:
    """The spawn call raised: the span ends now, before the error reaches the host."""
    if not _claim(child):
        return
    child.attributes[telemetry.ERROR_TYPE.name] = type(error).__qualname__
    child.blocked = blocked
    child.error = error
    child.end_ns = time_ns()
    _end(child)


def _exited(child: _Child, returncode: int) -> None:
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


def _claim(child: _Child) -> bool:
    """Take the child out of `_open`: True for the one caller that ends it (its reaper, its failed
    spawn or the shutdown; one dict operation, atomic under the GIL)."""
    claimed = _open.pop(id(child), None) is not None
    child.done = True
    if claimed and child.fate is not None:
        child_fate.forget(child.fate)
    return claimed


_spawned_names: set[str] = set()  # every executable name measured in this process: its `active` series


class _Active:
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


def _environment_with_context(env: Mapping[Any, Any] | None, child: _Child) -> dict[Any, Any]:
    """A copy of `env` (default `os.environ`) with the child span's W3C context as `TRACEPARENT`..."""
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


# ---- subprocess.Popen -----------------------------------------------------------------------------

# Popen.__init__(args, bufsize, executable, stdin, stdout, stderr, preexec_fn, close_fds, shell, cwd, env, ...)
_POPEN_POSITIONS = {"args": 0, "executable": 2, "preexec_fn": 6, "shell": 8, "env": 10}
_PLAIN_ARGV = frozenset({list, tuple, str, bytes})  # exact types that need no materializing (no ABC checks)


def _popen_arg(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    position = _POPEN_POSITIONS[name]
    return args[position] if len(args) > position else kwargs.get(name)


def popen_method(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """`vfork` or `fork`: what `_posixsubprocess` does for these Popen arguments (CPython 3.10+, Linux).

    `os.posix_spawn`, which Popen uses for a few argument combinations, is seen when it happens.
    """
    forks = (
        _popen_arg(args, kwargs, "preexec_fn") is not None
        or kwargs.get("user") is not None
        or kwargs.get("group") is not None
        or kwargs.get("extra_groups") is not None
        or not getattr(subprocess, "_USE_VFORK", True)
    )
    return "fork" if forks else "vfork"


def _popen_command(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[object, list[object]]:
    command = _popen_arg(args, kwargs, "args")
    shell = bool(_popen_arg(args, kwargs, "shell"))
    if type(command) is not list and isinstance(command, (str, bytes, os.PathLike)):
        argv: list[object] = [command]
    else:
        argv = list(command)
    if shell:
        text = argv[0] if argv else ""
        return text, argv
    executable = _popen_arg(args, kwargs, "executable")
    return (executable if executable is not None else (argv[0] if argv else "?")), argv


def _materialized(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Popen's arguments with an argv given as a one-shot iterable (a generator) made a list, so that
    recording it does not consume it. Popen makes it a list itself (`list(args)`): nothing changes for
    the host, and an iterable that raises raises the same error here, from the same call."""
    command = _popen_arg(args, kwargs, "args")
    if type(command) in _PLAIN_ARGV or isinstance(command, (str, bytes, os.PathLike, Sequence)):
        return args, kwargs
    if not isinstance(command, Iterable):
        return args, kwargs
    if args:
        return (list(command), *args[1:]), kwargs
    return args, {**kwargs, "args": list(command)}


def _popen_init(wrapped: Callable[..., None], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if _unrecorded.get():
        return wrapped(*args, **kwargs)
    outer = _in_loop_spawn.get()
    if outer is not None:  # a loop's spawn (standard loop, or uvloop's vfork route): the loop's span counts
        outer.method, outer.popen_args = None, (args, kwargs)  # the method is worked out after the spawn
        token = _in_popen.set(outer)
        try:
            wrapped(*args, **kwargs)
        finally:
            _in_popen.reset(token)
        _safely(_exec_seen, outer, instance.pid, args, kwargs)
        return None
    state = _state
    child = None
    if state is not None:
        args, kwargs = _materialized(args, kwargs)
        try:
            child = _begin(state, asyncio.events._get_running_loop(), None)
            child.popen_args = (args, kwargs)
            if state.propagate:
                _start_span_now(state, child, _popen_command(args, kwargs)[0])
                if len(args) <= _POPEN_POSITIONS["env"]:
                    kwargs = {**kwargs, "env": _environment_with_context(kwargs.get("env"), child)}
                    child.popen_args = (args, kwargs)
        except Exception:
            _fault()
    if child is None:
        return wrapped(*args, **kwargs)
    token = _in_popen.set(child)
    start = perf_counter()
    try:
        wrapped(*args, **kwargs)
    except BaseException as error:
        blocked = perf_counter() - start
        _in_popen.reset(token)
        _safely(_spawn_failed, child, error, blocked)
        raise
    blocked = perf_counter() - start
    _in_popen.reset(token)
    _safely(_exec_seen, child, instance.pid, args, kwargs)
    try:
        # An attribute, not a WeakKeyDictionary entry (6 µs per child here), set and read with
        # setattr/getattr: touching `__dict__` would make CPython 3.11+ build a dict for the object.
        setattr(instance, _CHILD_ATTRIBUTE, child)
        _spawned(child, instance.pid, blocked)
    except Exception:
        _fault()
    return None


def _popen_reaped(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        if instance.returncode is not None:
            child = getattr(instance, _CHILD_ATTRIBUTE, None)  # None on Popen's class (see _instrument)
            if child is not None:
                setattr(instance, _CHILD_ATTRIBUTE, None)
                _exited(child, instance.returncode)
    except Exception:
        _fault()
    return result


def _exec_seen(child: _Child, pid: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Right after `Popen.__init__` spawned `pid`: whether the child exec'd."""
    child.fate = child_fate.exec_seen(pid, lambda: popen_method(args, kwargs) == "fork")


def _safely(function: Callable[..., object], *args: Any) -> None:
    try:
        function(*args)
    except Exception:
        _fault()


# ---- os.posix_spawn and the wait functions --------------------------------------------------------


def _posix_spawn(wrapped: Callable[..., int], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if _unrecorded.get():
        return wrapped(*args, **kwargs)
    outer = _in_popen.get()
    if outer is not None:  # Popen chose posix_spawn: its own span records the method
        outer.method = "posix_spawn"
        return wrapped(*args, **kwargs)
    state = _state
    child = None
    if state is not None:
        try:
            child = _begin(state, asyncio.events._get_running_loop(), "posix_spawn")
            child.command = (args[0], args[1])
            if state.propagate:
                _start_span_now(state, child, args[0])
                if len(args) > 2:
                    args = (args[0], args[1], _environment_with_context(args[2], child), *args[3:])
        except Exception:
            _fault()
    if child is None:
        return wrapped(*args, **kwargs)
    start = perf_counter()
    try:
        pid = wrapped(*args, **kwargs)
    except BaseException as error:
        _safely(_spawn_failed, child, error, perf_counter() - start)
        raise
    blocked = perf_counter() - start
    try:
        _by_pid[pid] = child
        _spawned(child, pid, blocked)
    except Exception:
        _fault()
    return pid


def _waited(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if _by_pid:
        try:
            pid, status = result[0], result[1]
            child = _by_pid.get(pid) if pid else None
            if child is not None and (os.WIFEXITED(status) or os.WIFSIGNALED(status)):
                del _by_pid[pid]
                _exited(child, os.waitstatus_to_exitcode(status))
        except Exception:
            _fault()
    return result


# ---- a loop's subprocess_exec / subprocess_shell --------------------------------------------------


class _TimedSteps:
    """Awaits a coroutine and adds up the time spent inside its synchronous steps; calls
    `first_step_done` once, after the first step that did not finish the coroutine."""

    __slots__ = ("_coroutine", "_first_step_done", "blocked")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], first_step_done: Callable[[], None]) -> None:
        self._coroutine = coroutine
        self._first_step_done: Callable[[], None] | None = first_step_done
        self.blocked = 0.0

    def __await__(self) -> Generator[Any, Any, Any]:
        steps = self._coroutine.__await__()
        value: Any = None
        error: BaseException | None = None
        while True:
            start = perf_counter()
            try:
                yielded = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as stop:
                self.blocked += perf_counter() - start
                return stop.value
            except BaseException:
                self.blocked += perf_counter() - start
                raise
            self.blocked += perf_counter() - start
            if self._first_step_done is not None:
                first_step_done, self._first_step_done = self._first_step_done, None
                _safely(first_step_done)
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                self._coroutine.close()
                raise
            except BaseException as thrown:
                value, error = None, thrown


def _watch_protocol(protocol: Any, child: _Child, transports: list[Any]) -> None:
    """Learn the exit from the protocol's `process_exited`, which both loops call after reaping.

    The standard library's transports (the standard loop's, and the vfork route's under uvloop)
    call it on a later loop turn, and their `_wait()` returns at once once the return code is set,
    so `Process.wait()` can return before it: there the transport's `_process_exited`, which sets
    the return code, ends the span first. uvloop's own transport wakes its waiters after
    `process_exited` has run."""
    made = protocol.connection_made
    exited = protocol.process_exited

    def connection_made(transport: Any) -> Any:
        transports.append(transport)
        if isinstance(transport, asyncio.base_subprocess.BaseSubprocessTransport):
            _end_when_the_return_code_is_set(transport, child)
        return made(transport)

    def process_exited() -> Any:
        try:
            return exited()
        finally:
            try:
                returncode = transports[0].get_returncode() if transports else None
                if returncode is not None:
                    _exited(child, returncode)
            except Exception:
                _fault()

    protocol.connection_made = connection_made
    protocol.process_exited = process_exited


def _end_when_the_return_code_is_set(transport: Any, child: _Child) -> None:
    process_exited = transport._process_exited

    def ended_first(returncode: int) -> Any:
        try:
            _exited(child, returncode)
        except Exception:
            _fault()
        return process_exited(returncode)

    transport._process_exited = ended_first


def _watching_factory(protocol_factory: Callable[[], Any], child: _Child) -> Callable[[], Any]:
    def make() -> Any:
        protocol = protocol_factory()
        try:
            _watch_protocol(protocol, child, [])
        except AttributeError:  # a protocol with __slots__: the span then ends at shutdown
            _log.debug("stallwatch: cannot watch the exit of %r", protocol)
        except Exception:
            _fault()
        return protocol

    return make


def _fallback_reason() -> str | None:
    module = sys.modules.get("stallwatch.forksafe.uvloop_spawn")
    return module.FALLBACK.get() if module is not None else None


def _loop_wrapper(loop: str, shell: bool) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = _state
        child = None
        if state is not None and len(args) >= 2:
            try:
                child = _begin(state, loop, "fork" if loop == "uvloop" else "vfork")
                child.command = scrub.loop_command(args, shell)
                args = (_watching_factory(args[0], child), *args[1:])
                if state.propagate:
                    _start_span_now(state, child, args[1])
                    kwargs = {**kwargs, "env": _environment_with_context(kwargs.get("env"), child)}
            except Exception:
                _fault()
        if child is None:
            return await wrapped(*args, **kwargs)
        token = _in_loop_spawn.set(child)
        forked: dict[int, child_fate.Fate] = {}
        timed = None
        try:
            timed = _TimedSteps(wrapped(*args, **kwargs), lambda: _first_step_done(child, forked))
            result = await timed
        except BaseException as error:
            _in_loop_spawn.reset(token)
            _safely(_spawn_failed, child, error, timed.blocked if timed is not None else 0.0)
            raise
        _in_loop_spawn.reset(token)
        try:
            if loop == "uvloop" and (reason := _fallback_reason()) is not None:
                child.attributes[telemetry.SPAWN_FALLBACK.name] = reason
            pid = result[0].get_pid()
            if child.fate is None:  # uvloop's own fork
                child.fate = forked.get(pid) or child_fate.exec_seen(pid, lambda: True)
            _spawned(child, pid, timed.blocked)
        except Exception:
            _fault()
        return result

    return wrapper


def _first_step_done(child: _Child, forked: dict[int, child_fate.Fate]) -> None:
    """After the synchronous part of a loop's spawn, before the loop can reap the child: uvloop forked
    and waited for the exec there, and its pid is not known yet (`Popen` told the standard loop's)."""
    if child.fate is None:
        forked.update(child_fate.new_children())


def _patch_uvloop(module: Any) -> None:
    for name in _LOOP_METHODS:
        wrapt.wrap_function_wrapper(module, f"Loop.{name}", _loop_wrapper("uvloop", name == "subprocess_shell"))


class SubprocessInstrumentor(BaseInstrumentor):
    """Spans and metrics for every child process (see the module docstring for the paths).

    Keyword arguments of `instrument()`: `tracer_provider`, `meter_provider` (default: the global
    ones) and `settings` (a `stallwatch.Settings`: argument recording, scrub patterns, propagation
    to children; default: read from the environment).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()  # the standard library's; uvloop's loop methods are wrapped when it is installed

    def _instrument(self, **kwargs: Any) -> None:
        global _state

        try:
            settings = kwargs.get("settings") or Settings.load()
        except ConfigError as error:
            _log.error("stallwatch: %s; subprocess instrumentation stays off.", error)
            return
        meter_ = meter(kwargs.get("meter_provider"))
        FAULTS.bind(kwargs.get("meter_provider"))
        spawn_duration = _SpawnDurations(meter_, telemetry.SUBPROCESS_SPAWN_DURATION)
        _state = _State(
            tracer=trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, __version__, kwargs.get("tracer_provider")),
            spawn_duration=spawn_duration,
            exits=Counts(meter_, telemetry.SUBPROCESS_EXITS),  # counted as each child is reaped
            active=_Active(meter_, before=spawn_duration.drain),
            record_args=settings.record_args,
            patterns=settings.scrub_patterns,
            propagate=settings.propagate_to_children,
        )
        setattr(subprocess.Popen, _CHILD_ATTRIBUTE, None)  # the default: a lookup never raises
        wrapt.wrap_function_wrapper(subprocess.Popen, "__init__", _popen_init)
        wrapt.wrap_function_wrapper(subprocess.Popen, "_handle_exitstatus", _popen_reaped)
        for name in _POSIX_SPAWN_FUNCTIONS:
            if hasattr(os, name):
                wrapt.wrap_function_wrapper(os, name, _posix_spawn)
        for name in _WAIT_FUNCTIONS:
            wrapt.wrap_function_wrapper(os, name, _waited)
        for name in _LOOP_METHODS:
            wrapper = _loop_wrapper("asyncio", name == "subprocess_shell")
            wrapt.wrap_function_wrapper(asyncio.base_events.BaseEventLoop, name, wrapper)
        ImportHooks.of(self).on_import("uvloop", _patch_uvloop)
        _FORK_RESET.register()
        child_fate.install()

    def _uninstrument(self, **kwargs: Any) -> None:
        global _state
        _state = None
        ImportHooks.of(self).clear()
        child_fate.uninstall()
        unwrap(subprocess.Popen, "__init__")
        if _CHILD_ATTRIBUTE in vars(subprocess.Popen):
            delattr(subprocess.Popen, _CHILD_ATTRIBUTE)
        unwrap(subprocess.Popen, "_handle_exitstatus")
        for name in (*_POSIX_SPAWN_FUNCTIONS, *_WAIT_FUNCTIONS):
            if hasattr(os, name):
                unwrap(os, name)
        for name in _LOOP_METHODS:
            unwrap(asyncio.base_events.BaseEventLoop, name)
            uvloop = sys.modules.get("uvloop")
            if uvloop is not None:
                unwrap_method(uvloop.Loop, name)
