"""A loop's `subprocess_exec`/`subprocess_shell`, on the standard loop (`BaseEventLoop`) and on uvloop
(`uvloop.Loop`, whose layer `forksafe.uvloop_layers` places): a child's span from the call until the loop
calls the protocol's `process_exited`. `asyncio.create_subprocess_exec` and its `asyncio.subprocess`
binding both call these methods.

The spawn's blocked time is the sum of the coroutine's synchronous steps, not the time spent awaiting:
under uvloop's own spawn the fork and the wait for the child's exec happen in the first step, while
uvloop holds the GIL. A `Popen` inside (the standard loop's, or uvloop's routed spawn) only tells this
span how it spawned. The host gets the same transport, protocol and exception as from the bare call.
"""

from __future__ import annotations

import asyncio.base_events
import asyncio.base_subprocess
import asyncio.subprocess
import logging
from collections.abc import Callable, Coroutine, Generator
from time import perf_counter
from typing import Any

import wrapt

from ... import telemetry
from ...core import scrub
from ...forksafe import uvloop_layers, uvloop_spawn
from .. import child_fate
from .._lifecycle import unwrap
from . import children
from .children import (
    IN_LOOP_SPAWN,
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

_log = logging.getLogger("stallwatch")
_LOOP_METHODS = ("subprocess_exec", "subprocess_shell")


def install() -> None:
    global _returncode_before
    for name in _LOOP_METHODS:
        wrapper = _loop_wrapper("asyncio", name == "subprocess_shell")
        wrapt.wrap_function_wrapper(asyncio.base_events.BaseEventLoop, name, wrapper)
    uvloop_layers.add("record", _loop_wrapper("uvloop", shell=False), _loop_wrapper("uvloop", shell=True))
    wrapt.wrap_function_wrapper(asyncio.subprocess.Process, "wait", _process_wait)
    found = asyncio.subprocess.Process.__dict__["returncode"]
    if found.fget is not _process_returncode:
        _returncode_before = found
        asyncio.subprocess.Process.returncode = property(_process_returncode)  # type: ignore[method-assign,assignment]


def uninstall() -> None:
    global _returncode_before
    uvloop_layers.remove("record")
    for name in _LOOP_METHODS:
        unwrap(asyncio.base_events.BaseEventLoop, name)
    unwrap(asyncio.subprocess.Process, "wait")
    if _returncode_before is not None:
        asyncio.subprocess.Process.returncode = _returncode_before  # type: ignore[method-assign,assignment]
        _returncode_before = None


_returncode_before: property | None = None  # `asyncio.subprocess.Process.returncode` as found at `install()`


def _seen_exit(process: asyncio.subprocess.Process, returncode: int) -> None:
    """The host has seen `process` exit (its `wait()` returned, or its `returncode` was read set): end
    the child's span now if the loop has not called the protocol's `process_exited` yet."""
    try:
        child = getattr(process._protocol, "_stallwatch_child", None)  # type: ignore[attr-defined]
        if child is not None and not child.done:
            exited(child, returncode)
    except Exception:
        fault()


async def _process_wait(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    returncode = await wrapped(*args, **kwargs)
    _seen_exit(instance, returncode)
    return returncode


def _process_returncode(process: asyncio.subprocess.Process) -> int | None:
    before = _returncode_before
    returncode = before.fget(process) if before is not None else process._transport.get_returncode()  # type: ignore[misc,attr-defined]
    if returncode is not None:
        _seen_exit(process, returncode)
    return returncode


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
                safely(first_step_done)
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                self._coroutine.close()
                raise
            except BaseException as thrown:
                value, error = None, thrown


def _watch_protocol(protocol: Any, child: Child, transports: list[Any]) -> None:
    """Learn the exit from the protocol's `process_exited`, which both loops call a loop turn or more
    after the return code is set, while `Process.wait()` returns, and `Process.returncode` reads it, as
    soon as it is set. So the span also ends where the host can see the exit first: the standard
    library transport's `_process_exited`, which sets it (hooked once the transport is connected), and
    `Process.wait()` and `Process.returncode` (`_seen_exit`, through the `_stallwatch_child` the
    protocol carries), for uvloop's own transport, a Cython object, and for an exit the standard
    library's child watcher reported before the transport was connected."""
    made = protocol.connection_made
    hosts_process_exited = protocol.process_exited
    protocol._stallwatch_child = child

    def connection_made(transport: Any) -> Any:
        transports.append(transport)
        if isinstance(transport, asyncio.base_subprocess.BaseSubprocessTransport):
            _end_when_the_return_code_is_set(transport, child)
        return made(transport)

    def process_exited() -> Any:
        try:
            return hosts_process_exited()
        finally:
            try:
                returncode = transports[0].get_returncode() if transports else None
                if returncode is not None:
                    exited(child, returncode)
            except Exception:
                fault()

    protocol.connection_made = connection_made
    protocol.process_exited = process_exited


def _end_when_the_return_code_is_set(transport: Any, child: Child) -> None:
    process_exited = transport._process_exited

    def ended_first(returncode: int) -> Any:
        try:
            exited(child, returncode)
        except Exception:
            fault()
        return process_exited(returncode)

    transport._process_exited = ended_first


def _watching_factory(protocol_factory: Callable[[], Any], child: Child) -> Callable[[], Any]:
    def make() -> Any:
        protocol = protocol_factory()
        try:
            _watch_protocol(protocol, child, [])
        except AttributeError:  # a protocol with __slots__: the span then ends at shutdown
            _log.debug("stallwatch: cannot watch the exit of %r", protocol)
        except Exception:
            fault()
        return protocol

    return make


def _loop_wrapper(loop: str, shell: bool) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = children.ACTIVE
        child = None
        if state is not None and len(args) >= 2:
            try:
                child = begin(state, loop, "fork" if loop == "uvloop" else "vfork")
                child.command = scrub.loop_command(args, shell)
                args = (_watching_factory(args[0], child), *args[1:])
                if state.propagate:
                    start_span_now(state, child, args[1])
                    kwargs = {**kwargs, "env": environment_with_context(kwargs.get("env"), child)}
            except Exception:
                fault()
        if child is None:
            return await wrapped(*args, **kwargs)
        token = IN_LOOP_SPAWN.set(child)
        forked: dict[int, child_fate.Fate] = {}
        timed = None
        try:
            timed = _TimedSteps(wrapped(*args, **kwargs), lambda: _first_step_done(child, forked))
            result = await timed
        except BaseException as error:
            IN_LOOP_SPAWN.reset(token)
            safely(spawn_failed, child, error, timed.blocked if timed is not None else 0.0)
            raise
        IN_LOOP_SPAWN.reset(token)
        try:
            if loop == "uvloop" and (reason := uvloop_spawn.FALLBACK.get()) is not None:
                child.attributes[telemetry.SPAWN_FALLBACK.name] = reason
            pid = result[0].get_pid()
            if child.fate is None:  # uvloop's own fork
                child.fate = forked.get(pid) or child_fate.exec_seen(pid, forked=True)
            spawned(child, pid, timed.blocked)
        except Exception:
            fault()
        return result

    return wrapper


def _first_step_done(child: Child, forked: dict[int, child_fate.Fate]) -> None:
    """After the synchronous part of a loop's spawn, before the loop can reap the child: uvloop forked
    and waited for the exec there, and its pid is not known yet (`Popen` told the standard loop's)."""
    if child.fate is None:
        forked.update(child_fate.new_children())
