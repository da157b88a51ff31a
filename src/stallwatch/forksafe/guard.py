"""Exec-bound child guard and fork accounting.

A real `fork()` runs every Python `os.register_at_fork` handler in the child. uvloop forks for
every subprocess and runs them although the child only execs (incident 000 in docs/incidents.md; uvloop#749), and so
does `Popen(preexec_fn=...)`. This module wraps `os.register_at_fork` at `import stallwatch`, so
each handler registered afterwards is skipped when the fork is *exec-bound*: the fork happens
inside a uvloop `subprocess_exec`/`subprocess_shell` call (this module's layer in `uvloop_layers`)
or a `Popen` with `preexec_fn`, which this module marks with a context variable. Children of a plain
`os.fork()` keep every handler.

It also counts each fork (`stallwatch.fork.count`) with plain integers in the `before` handler:
no lock and no SDK call happens inside the fork window, where the parent may hold the GIL.
No library offers this guard (CPython has no way to unregister or filter at-fork handlers), hence
the hand-written wrapper.
"""

from __future__ import annotations

import contextvars
import os
import subprocess
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import wrapt

from .._record import Record
from ..core import scrub
from . import uvloop_layers
from .grpc_guard import GrpcActivity
from .loop import running_loop_kind

Handler = Callable[[], object]

_exec_bound: contextvars.ContextVar[bool] = contextvars.ContextVar("stallwatch_exec_bound", default=False)


class _ForkState:
    """Process-wide fork facts. A child inherits a copy of the parent's values at fork time."""

    def __init__(self) -> None:
        self.forking_exec_bound = False  # set by our `before` handler, read in the child
        self.child_exec_bound = False  # this process is a child that is about to exec
        self.in_child_handler = False  # a guarded after_in_child handler is running now
        self.probe = False  # doctor's test fork: the child runs guarded handlers one at a time itself
        self.fork_counts: dict[tuple[str, bool, str], int] = {}
        self.handlers_skipped = 0
        self.guarded_handlers = 0  # callables registered through the guard (skipped per exec-bound fork)
        self.workers_deferred = 0
        self.pending: list[_Deferred] = []
        self.restart_lock = threading.Lock()
        self.exiting = False  # interpreter exit began: no deferred worker restarts from now on
        self.drain_wanted = False  # telemetry was made after that: `drain_pending()` exports it


class _Deferred:
    """A worker restart deferred in a fork child: `restart(obj)` starts its thread; `drain(obj)`,
    when given, exports what `obj` holds on the calling thread instead."""

    def __init__(
        self, ref: weakref.ReferenceType[Any], restart: Callable[[Any], object], drain: Callable[[Any], object] | None
    ) -> None:
        self.ref = ref
        self.restart = restart
        self.drain = drain


STATE = _ForkState()
_grpc_activity = GrpcActivity()


class Registration:
    """One `os.register_at_fork` call made after `import stallwatch`."""

    __slots__ = ("after_in_child", "after_in_parent", "before")

    def __init__(self, before: Handler | None, after_in_parent: Handler | None, after_in_child: Handler | None) -> None:
        self.before = before
        self.after_in_parent = after_in_parent
        self.after_in_child = after_in_child

    @property
    def description(self) -> str:
        """Qualified name of what the handler calls, e.g. `BatchProcessor._at_fork_reinit`."""
        fn = self.after_in_child or self.before or self.after_in_parent
        return describe_handler(fn) if fn is not None else "?"


REGISTRATIONS: list[Registration] = []
_original_register_at_fork = os.register_at_fork


def describe_handler(fn: Callable[..., object]) -> str:
    """Best human name for a fork handler, resolving the SDK's WeakMethod closures."""
    target = _weak_target(fn)
    if target is not None:
        return target
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        return f"{type(owner).__qualname__}.{getattr(fn, '__name__', '?')}"
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _weak_target(fn: Callable[..., object]) -> str | None:
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, weakref.WeakMethod):
            method = value()
            if method is None:
                return "(collected object)"
            return f"{type(method.__self__).__qualname__}.{method.__func__.__name__}"
    return None


# ---- the guard ----------------------------------------------------------------------------------


def _guard_parent_side(fn: Handler) -> Handler:
    def guarded() -> object:
        if _exec_bound.get():
            return None
        return fn()

    guarded.__wrapped__ = fn  # type: ignore[attr-defined]
    return guarded


def _guard_child(fn: Handler) -> Handler:
    def guarded() -> object:
        if STATE.child_exec_bound or STATE.probe:
            return None
        return run_child_handler(fn)

    guarded.__wrapped__ = fn  # type: ignore[attr-defined]
    return guarded


def run_child_handler(fn: Handler) -> object:
    """Run one after_in_child handler the way the guard does (patched OTel code defers work)."""
    STATE.in_child_handler = True
    try:
        return fn()
    finally:
        STATE.in_child_handler = False


def _register_at_fork(
    wrapped: Callable[..., Any], instance: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    before = kwargs.get("before")
    parent = kwargs.get("after_in_parent")
    child = kwargs.get("after_in_child")
    if (
        args
        or set(kwargs) - {"before", "after_in_parent", "after_in_child"}
        or not all(f is None or callable(f) for f in (before, parent, child))
    ):
        return wrapped(*args, **kwargs)  # let CPython raise its own TypeError
    guarded = {
        key: guard(fn)
        for key, fn, guard in (
            ("before", before, _guard_parent_side),
            ("after_in_parent", parent, _guard_parent_side),
            ("after_in_child", child, _guard_child),
        )
        if fn is not None
    }
    result = wrapped(**guarded)
    REGISTRATIONS.append(Registration(before, parent, child))
    STATE.guarded_handlers += len(guarded)  # counted once here, not on every fork
    return result


# ---- what a layer above does around forks and spawns (the heartbeat, as it starts) --------------


class SpawnNotes(Protocol):
    """Where an exec-bound uvloop spawn is noted for the watchdog while it lasts."""

    def spawning(self, command: str, trace_id: int, span_id: int) -> None: ...

    def spawned(self) -> None: ...


def _nothing() -> None:
    return None


def _no_notes() -> SpawnNotes | None:
    return None


class ForkListener(Record):
    """What the guard's own handlers call besides their bookkeeping; no-ops until `listen()`:
    `before_fork` before a fork whose child may live on, `after_fork_in_parent` after that fork in the
    parent, `in_child` first thing in every fork child, `spawn_notes` where to note a uvloop spawn (if
    anywhere)."""

    __slots__ = ("after_fork_in_parent", "before_fork", "in_child", "spawn_notes")
    before_fork: Callable[[], None]
    after_fork_in_parent: Callable[[], None]
    in_child: Callable[[], None]
    spawn_notes: Callable[[], SpawnNotes | None]

    def __init__(self, before_fork: Callable[[], None] = _nothing, after_fork_in_parent: Callable[[], None] = _nothing,
                 in_child: Callable[[], None] = _nothing,
                 spawn_notes: Callable[[], SpawnNotes | None] = _no_notes) -> None:  # fmt: skip
        self._set(before_fork=before_fork, after_fork_in_parent=after_fork_in_parent, in_child=in_child,
                  spawn_notes=spawn_notes)  # fmt: skip


_listener = ForkListener()


def listen(listener: ForkListener) -> None:
    """Make the guard's handlers call `listener` from now on (one listener: a later call replaces it)."""
    global _listener
    _listener = listener


# ---- our own handlers (registered unguarded, before anything else after import) ----------------


def _before_fork() -> None:
    exec_bound = _exec_bound.get()
    STATE.forking_exec_bound = exec_bound
    key = ("exec_bound" if exec_bound else "fork", _grpc_activity.active(), running_loop_kind())
    STATE.fork_counts[key] = STATE.fork_counts.get(key, 0) + 1
    if exec_bound:
        STATE.handlers_skipped += STATE.guarded_handlers
    else:  # a child that may live on and exit: faulthandler's timer must not be armed in it
        _listener.before_fork()


def _after_in_parent() -> None:
    if not STATE.forking_exec_bound:
        _listener.after_fork_in_parent()
    STATE.forking_exec_bound = False


def _after_in_child() -> None:
    STATE.child_exec_bound = STATE.forking_exec_bound
    _listener.in_child()  # one store: the parent's heartbeat is never the child's to write
    if STATE.child_exec_bound:
        return  # a child about to exec does no work at all
    STATE.restart_lock = threading.Lock()
    STATE.pending = []
    STATE.drain_wanted = False
    STATE.fork_counts = {}
    STATE.handlers_skipped = 0
    STATE.workers_deferred = 0


# ---- deferred worker restarts ------------------------------------------------------------------


def defer(obj: object, restart: Callable[[Any], object], drain: Callable[[Any], object] | None = None) -> None:
    """Remember to run `restart(obj)` on first telemetry use in this (forked) process.

    `drain(obj)` is for a restart that starts a thread: at interpreter exit (Python 3.12 refuses
    new threads there) the restart is skipped and `drain_pending()` exports on the calling thread.
    """
    STATE.pending.append(_Deferred(weakref.ref(obj), restart, drain))
    STATE.workers_deferred += 1


def is_deferred(obj: object) -> bool:
    """True while `obj` waits for its restart (or, at exit, for its drain)."""
    return any(entry.ref() is obj for entry in STATE.pending)


def restart_pending() -> None:
    """Run every deferred restart once; called on first use of telemetry in a fork child.

    Once interpreter exit began, restarts that would start a thread stay deferred, for
    `drain_pending()`; the others (resource detection) still run.
    """
    if STATE.child_exec_bound or STATE.in_child_handler:
        return
    with STATE.restart_lock:
        if STATE.exiting:
            STATE.drain_wanted = True
            run = [entry for entry in STATE.pending if entry.drain is None]
            STATE.pending = [entry for entry in STATE.pending if entry.drain is not None]
        else:
            run, STATE.pending = STATE.pending, []
    for entry in run:
        obj = entry.ref()
        if obj is not None:
            entry.restart(obj)


def drain_pending() -> None:
    """Export, on this thread, what the workers left deferred at exit hold (see `defer`).

    Does nothing unless telemetry was made after interpreter exit began, in a fork child whose
    workers had not restarted yet: the case where no worker thread can take it.
    """
    with STATE.restart_lock:
        if not STATE.drain_wanted:
            return
        STATE.drain_wanted = False
        drains = [(entry.ref, entry.drain) for entry in STATE.pending if entry.drain is not None]
    for ref, drain in drains:
        obj = ref()
        if obj is not None:
            drain(obj)


def _interpreter_exiting() -> None:
    STATE.exiting = True


# ---- marking exec-bound forks -------------------------------------------------------------------


def _mark_uvloop_spawn(shell: bool) -> Callable[..., Awaitable[Any]]:
    """The wrapper of uvloop's `subprocess_shell` (`shell`) or `subprocess_exec`."""

    async def wrapper(
        wrapped: Callable[..., Awaitable[Any]], instance: object, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        token = _exec_bound.set(True)
        area = _listener.spawn_notes()
        if area is not None:  # tell the watchdog what is being spawned, in case the spawn freezes us
            _note_spawn(area, args, shell)
        try:
            return await wrapped(*args, **kwargs)
        finally:
            _exec_bound.reset(token)
            if area is not None:
                area.spawned()

    return wrapper


def _note_spawn(area: SpawnNotes, args: tuple[Any, ...], shell: bool) -> None:
    """Executable name and argument count only, counted as on the spawn's span: no argument leaves the process."""
    from opentelemetry import trace

    if len(args) > 1:  # a shell command's `PGPASSWORD=... psql` gives "psql"
        program, argv = scrub.loop_command(args, shell)
        command = f"{scrub.executable_name(program)} ({scrub.args_count(argv)} args)"
    else:
        command = "? (? args)"
    context = trace.get_current_span().get_span_context()
    area.spawning(command, context.trace_id, context.span_id)


def _mark_preexec_popen(
    wrapped: Callable[..., Any], instance: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    # Popen._execute_child(args, executable, preexec_fn, ...): positional in every CPython 3.10+.
    preexec_fn = args[2] if len(args) > 2 else kwargs.get("preexec_fn")
    if preexec_fn is None:
        return wrapped(*args, **kwargs)
    token = _exec_bound.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _exec_bound.reset(token)


_installed = False


def install() -> None:
    """Wrap `os.register_at_fork`, register our own handlers, and mark exec-bound spawns."""
    global _installed
    if _installed:
        return
    _installed = True
    _original_register_at_fork(before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
    # Runs when interpreter exit begins, before every `atexit` callback (the host's included), in
    # the parent and in each fork child: the hook concurrent.futures uses for the same reason.
    register_exit = getattr(threading, "_register_atexit", None)
    if register_exit is not None:
        register_exit(_interpreter_exiting)
    wrapt.wrap_function_wrapper(os, "register_at_fork", _register_at_fork)
    wrapt.wrap_function_wrapper(subprocess.Popen, "_execute_child", _mark_preexec_popen)
    uvloop_layers.add("guard", _mark_uvloop_spawn(shell=False), _mark_uvloop_spawn(shell=True))


def installed() -> bool:
    """True once `install()` ran in this process."""
    return _installed


def grpc_active() -> bool:
    """Whether gRPC core threads run in this process now (cached for a second; never imports grpc)."""
    return _grpc_activity.active()


def fork_counts() -> Iterator[tuple[tuple[str, bool, str], int]]:
    """Snapshot of fork counts by (kind, gRPC active, loop)."""
    return iter(list(STATE.fork_counts.items()))
