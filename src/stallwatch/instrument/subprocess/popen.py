"""`subprocess.Popen` (so `run`, `call`, `check_output`): a child's span from `Popen.__init__` to
`Popen._handle_exitstatus`, where `wait()`/`poll()` reap it.

A `Popen` inside a loop's spawn (the standard loop's, or uvloop's routed through `Popen`) only tells the
loop's span how it spawned. With propagation on, the child's environment gets the span's `TRACEPARENT`
(when `env` is not given positionally). The host gets the same result, exception, pid and pipes.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from time import perf_counter
from typing import Any

import wrapt

from .. import child_fate
from .._lifecycle import unwrap
from . import children
from .arguments import POPEN_POSITIONS, materialized, popen_command, popen_method
from .children import (
    IN_LOOP_SPAWN,
    IN_POPEN,
    UNRECORDED,
    Child,
    begin,
    environment_with_context,
    exited,
    fault,
    safely,
    spawn_failed,
    spawned,
    start_span_now,
)

_CHILD_ATTRIBUTE = "_stallwatch_child"  # on a Popen: its child from its spawn to its reaping, then None


def install() -> None:
    setattr(subprocess.Popen, _CHILD_ATTRIBUTE, None)  # the default: a lookup never raises
    wrapt.wrap_function_wrapper(subprocess.Popen, "__init__", _popen_init)
    wrapt.wrap_function_wrapper(subprocess.Popen, "_handle_exitstatus", _popen_reaped)


def uninstall() -> None:
    unwrap(subprocess.Popen, "__init__")
    if _CHILD_ATTRIBUTE in vars(subprocess.Popen):
        delattr(subprocess.Popen, _CHILD_ATTRIBUTE)
    unwrap(subprocess.Popen, "_handle_exitstatus")


def _popen_init(wrapped: Callable[..., None], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if UNRECORDED.get():
        return wrapped(*args, **kwargs)
    outer = IN_LOOP_SPAWN.get()
    if outer is not None:  # a loop's spawn (standard loop, or uvloop's vfork route): the loop's span counts
        outer.method, outer.popen_args = popen_method(args, kwargs), (args, kwargs)  # posix_spawn may say otherwise
        token = IN_POPEN.set(outer)
        try:
            wrapped(*args, **kwargs)
        finally:
            IN_POPEN.reset(token)
        safely(_exec_seen, outer, instance.pid)
        return None
    state = children.ACTIVE
    child = None
    if state is not None:
        args, kwargs = materialized(args, kwargs)
        try:
            child = begin(state, asyncio.events._get_running_loop(), popen_method(args, kwargs))
            child.popen_args = (args, kwargs)
            if state.propagate:
                start_span_now(state, child, popen_command(args, kwargs)[0])
                if len(args) <= POPEN_POSITIONS["env"]:
                    kwargs = {**kwargs, "env": environment_with_context(kwargs.get("env"), child)}
                    child.popen_args = (args, kwargs)
        except Exception:
            fault()
    if child is None:
        return wrapped(*args, **kwargs)
    token = IN_POPEN.set(child)
    start = perf_counter()
    try:
        wrapped(*args, **kwargs)
    except BaseException as error:
        blocked = perf_counter() - start
        IN_POPEN.reset(token)
        safely(spawn_failed, child, error, blocked)
        raise
    blocked = perf_counter() - start
    IN_POPEN.reset(token)
    try:
        # An attribute, not a WeakKeyDictionary entry (cheaper per child), set and read with
        # setattr/getattr: touching `__dict__` would make CPython 3.11+ build a dict for the object.
        setattr(instance, _CHILD_ATTRIBUTE, child)
        spawned(child, instance.pid, blocked)
    except Exception:
        fault()
    return None


def _popen_reaped(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        if instance.returncode is not None:
            child = getattr(instance, _CHILD_ATTRIBUTE, None)  # None on Popen's class (see `install`)
            if child is not None:
                setattr(instance, _CHILD_ATTRIBUTE, None)
                exited(child, instance.returncode)
    except Exception:
        # At the interpreter's exit, a Popen's `__del__` may poll after this module's globals were
        # cleared (None): nothing is left to record then, and the host's stderr stays untouched.
        if fault is not None:
            fault()
    return result


def _exec_seen(child: Child, pid: int) -> None:
    """Right after a loop's `Popen` spawned `pid`: whether the child exec'd."""
    child.fate = child_fate.exec_seen(pid, forked=child.method == "fork")
