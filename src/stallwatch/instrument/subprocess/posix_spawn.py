"""`os.posix_spawn`/`os.posix_spawnp` called directly: a child's span from the call until one of
`os.waitpid`/`wait`/`wait3`/`wait4` reaps it (checked against the pids spawned here).

A `posix_spawn` inside `Popen` only tells the `Popen`'s span its method. The wait functions return
what they return for the host; while no directly spawned child is waiting, they check one empty dict.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from time import perf_counter
from typing import Any

import wrapt

from .._lifecycle import unwrap
from . import children
from .children import (
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

_WAIT_FUNCTIONS = ("waitpid", "wait", "wait3", "wait4")
_POSIX_SPAWN_FUNCTIONS = ("posix_spawn", "posix_spawnp")
BY_PID: dict[int, Child] = {}  # children of direct os.posix_spawn calls, until a wait function reaps them


def install() -> None:
    for name in _POSIX_SPAWN_FUNCTIONS:
        if hasattr(os, name):
            wrapt.wrap_function_wrapper(os, name, _posix_spawn)
    for name in _WAIT_FUNCTIONS:
        wrapt.wrap_function_wrapper(os, name, _waited)


def uninstall() -> None:
    for name in (*_POSIX_SPAWN_FUNCTIONS, *_WAIT_FUNCTIONS):
        if hasattr(os, name):
            unwrap(os, name)


def _posix_spawn(wrapped: Callable[..., int], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if UNRECORDED.get():
        return wrapped(*args, **kwargs)
    outer = IN_POPEN.get()
    if outer is not None:  # Popen chose posix_spawn: its own span records the method
        outer.method = "posix_spawn"
        return wrapped(*args, **kwargs)
    state = children.ACTIVE
    child = None
    if state is not None:
        try:
            child = begin(state, asyncio.events._get_running_loop(), "posix_spawn")
            child.command = (args[0], args[1])
            if state.propagate:
                start_span_now(state, child, args[0])
                if len(args) > 2:
                    args = (args[0], args[1], environment_with_context(args[2], child), *args[3:])
        except Exception:
            fault()
    if child is None:
        return wrapped(*args, **kwargs)
    start = perf_counter()
    try:
        pid = wrapped(*args, **kwargs)
    except BaseException as error:
        safely(spawn_failed, child, error, perf_counter() - start)
        raise
    blocked = perf_counter() - start
    try:
        BY_PID[pid] = child
        spawned(child, pid, blocked)
    except Exception:
        fault()
    return pid


def _waited(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if BY_PID:
        try:
            pid, status = result[0], result[1]
            child = BY_PID.get(pid) if pid else None
            if child is not None and (os.WIFEXITED(status) or os.WIFSIGNALED(status)):
                del BY_PID[pid]
                exited(child, os.waitstatus_to_exitcode(status))
        except Exception:
            fault()
    return result
