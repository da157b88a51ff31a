"""``STALLWATCH_UVLOOP_SPAWN=vfork`` (the default from ``import stallwatch`` on; ``fork`` opts out): uvloop
stays the event loop, but its ``Loop.subprocess_exec``/``subprocess_shell`` spawn through ``Popen`` (vfork or
posix_spawn, where no at-fork handler runs) instead of libuv's ``fork()``. docs/uvloop.md holds the user's view.

Contract: the transport is the standard library's ``_UnixSubprocessTransport``, so pipes, streams,
``communicate``, flow control and the callback order are the stdlib loop's; the argument checks and their
exceptions copy ``BaseEventLoop``'s. Each pipe reaches uvloop as a `_LibuvPipe`, so every descriptor is closed
exactly once; a write to the child's stdin once its pipe is closing (as the exit may close it) is dropped as on
the stdlib loop, not a `RuntimeError` (`_StdinPipe`). The exit is watched with a pidfd on the loop (no child
watcher: uvloop refuses asyncio's), and signals go through the pidfd, so a recycled pid is never hit. A call
the route cannot honour (`unsupported_reason`: ``preexec_fn``/``user``/``group``/``extra_groups``, a keyword
``Popen`` lacks, no pidfds, changed stdlib internals) goes to uvloop's own spawn unchanged, with `FALLBACK` set
and one INFO line per reason.
`install()` puts this module's layer on uvloop's methods through `uvloop_layers` (innermost, see there).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import os
import signal as _signal
import subprocess
import weakref
from asyncio import base_subprocess, unix_events
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from . import uvloop_layers

SETTING = "STALLWATCH_UVLOOP_SPAWN"

FALLBACK: contextvars.ContextVar[str | None] = contextvars.ContextVar("stallwatch_uvloop_spawn_fallback", default=None)
"""Set by every wrapped spawn: the reason it used uvloop's own fork although routing is on, else None."""

_log = logging.getLogger("stallwatch.forksafe")

# Arguments that asyncio's subprocess_exec/subprocess_shell check themselves before Popen sees them.
_ASYNCIO_ARGUMENTS = frozenset(
    {"stdin", "stdout", "stderr", "universal_newlines", "shell", "bufsize", "encoding", "errors", "text"}
)
# Popen arguments with which CPython's _posixsubprocess uses fork() instead of vfork().
_FORCE_FORK = ("preexec_fn", "user", "group", "extra_groups")
_POPEN_ARGUMENTS = frozenset(inspect.signature(subprocess.Popen.__init__).parameters) - {"self", "args"}
_ROUTABLE = _ASYNCIO_ARGUMENTS | _POPEN_ARGUMENTS

_EXPECTED_SIGNATURES = {
    "__init__": (
        "self",
        "loop",
        "protocol",
        "args",
        "shell",
        "stdin",
        "stdout",
        "stderr",
        "bufsize",
        "waiter",
        "extra",
    ),
    "_start": ("self", "args", "shell", "stdin", "stdout", "stderr", "bufsize"),
    "_process_exited": ("self", "returncode"),
    "_wait": ("self",),
    "_check_proc": ("self",),
}


def _stdlib_transport() -> type[base_subprocess.BaseSubprocessTransport] | None:
    """The stdlib's Unix subprocess transport if its private API is the one this module was written
    against (the same in CPython 3.10 to 3.13), else None."""
    cls = getattr(unix_events, "_UnixSubprocessTransport", None)
    if not (isinstance(cls, type) and issubclass(cls, base_subprocess.BaseSubprocessTransport)):
        return None
    for name, expected in _EXPECTED_SIGNATURES.items():
        method = getattr(cls, name, None)
        try:
            params = inspect.signature(method).parameters.values()  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        named = tuple(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
        if named != expected:
            return None
    if not inspect.iscoroutinefunction(cls._wait):
        return None
    return cls


_STDLIB_TRANSPORT = _stdlib_transport()


@functools.cache
def _pidfd_unavailable() -> bool:
    """True when this kernel (or a seccomp filter) refuses pidfd_open or pidfd_send_signal."""
    try:
        pidfd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return True
    try:
        _signal.pidfd_send_signal(pidfd, 0)
    except (AttributeError, OSError):
        return True
    finally:
        os.close(pidfd)
    return False


def unsupported_reason(kwargs: Mapping[str, Any]) -> str | None:
    """Why a spawn with these keyword arguments cannot go through Popen's vfork, or None if it can."""
    if _STDLIB_TRANSPORT is None:
        return "stdlib-internals"
    if _pidfd_unavailable():
        return "pidfd"
    for name in _FORCE_FORK:
        if kwargs.get(name) is not None:
            return name
    unknown = sorted(set(kwargs) - _ROUTABLE)
    if unknown:
        return "unknown keyword: " + ", ".join(unknown)
    return None


class _LibuvPipe:
    """One of the child's pipes as the stdlib transport hands it to uvloop's `connect_read_pipe` or
    `connect_write_pipe`, in place of the `Popen` file object.

    uvloop gives `fileno()` to libuv, which closes that descriptor when the pipe transport closes,
    and then calls `close()` on the object it was given as well. With the file object itself, that
    closes the same number a second time: by then it may be a descriptor another thread has just
    opened (a file, a database socket) or, once that thread closes "its" file, a connection the
    loop has just accepted. Here `fileno()` gives libuv a duplicate of its own and closes the file,
    so that each descriptor is closed exactly once, whichever closes first; a pipe never handed to
    libuv is closed with the file.
    """

    __slots__ = ("_fd", "_file")

    def __init__(self, file: Any) -> None:
        self._file = file
        self._fd: int | None = None

    def fileno(self) -> int:
        if self._fd is None:
            self._fd = os.dup(self._file.fileno())
            self._file.close()
        return self._fd

    def close(self) -> None:
        self._file.close()

    def __repr__(self) -> str:
        return f"<pipe for the loop: {self._file!r}{'' if self._fd is None else f' handed over as fd {self._fd}'}>"


class _StdinPipe:
    """The child's stdin pipe transport as `get_pipe_transport(0)` hands it out (to the streams' `StreamWriter`):
    uvloop's `WriteUnixTransport`, except that `write()`/`writelines()` once it is closing drop the data, as the
    stdlib's pipe transport does, instead of raising `RuntimeError` on the closed handle. Everything else is
    uvloop's own; a pipe the host connects with `connect_write_pipe` is never wrapped."""

    __slots__ = ("_pipe",)

    def __init__(self, pipe: asyncio.WriteTransport) -> None:
        self._pipe = pipe

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pipe.is_closing():
            self._pipe.write(data)

    def writelines(self, list_of_data: Any) -> None:
        if not self._pipe.is_closing():
            self._pipe.writelines(list_of_data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __repr__(self) -> str:
        return f"<stdin pipe of a routed spawn: {self._pipe!r}>"


class _PidfdSubprocessTransport(_STDLIB_TRANSPORT or base_subprocess.BaseSubprocessTransport):  # type: ignore[misc]
    """The stdlib transport, told of the child's exit by a pidfd on the loop instead of a child
    watcher, with the child's pipes handed to uvloop as `_LibuvPipe` objects."""

    _pidfd: int
    _release_pidfd: weakref.finalize
    _exited: asyncio.Future[int]
    """Resolved with the return code at exit, whether or not the pipes ever connected."""
    _stdin: _StdinPipe | None = None

    def _start(self, args: Any, shell: bool, stdin: Any, stdout: Any, stderr: Any, bufsize: int, **kwargs: Any) -> None:
        self._exited = self._loop.create_future()
        super()._start(args=args, shell=shell, stdin=stdin, stdout=stdout, stderr=stderr, bufsize=bufsize, **kwargs)
        for name in ("stdin", "stdout", "stderr"):
            pipe = getattr(self._proc, name)
            if pipe is not None:
                setattr(self._proc, name, _LibuvPipe(pipe))
        # On failure from here, BaseSubprocessTransport.__init__ closes us, which kills the child.
        self._pidfd = os.pidfd_open(self._proc.pid)
        # Closes the pidfd once: on exit, or when a loop closed without running us drops the transport.
        self._release_pidfd = weakref.finalize(self, os.close, self._pidfd)
        self._loop.add_reader(self._pidfd, self._child_exited)

    def get_pipe_transport(self, fd: int) -> Any:
        pipe = super().get_pipe_transport(fd)
        if fd != 0 or pipe is None:
            return pipe
        if self._stdin is None:
            self._stdin = _StdinPipe(pipe)
        return self._stdin

    def _child_exited(self) -> None:
        try:
            pid, status = os.waitpid(self._proc.pid, os.WNOHANG)
        except ChildProcessError:
            returncode = self._proc.returncode  # reaped by Popen.poll() (our own close() calls it)
            if returncode is None:
                _log.warning("child process pid %d exit status already read: will report returncode 255", self._pid)
                returncode = 255
        else:
            if pid == 0:
                return  # not exited yet: keep watching
            returncode = os.waitstatus_to_exitcode(status)
        self._loop.remove_reader(self._pidfd)
        self._release_pidfd()
        self._process_exited(returncode)
        if not self._exited.done():
            self._exited.set_result(returncode)

    def send_signal(self, signal: int) -> None:
        self._check_proc()
        if self._returncode is not None:
            raise ProcessLookupError
        _signal.pidfd_send_signal(self._pidfd, signal)

    def terminate(self) -> None:
        self.send_signal(_signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(_signal.SIGKILL)


def _check_text_arguments(bufsize: int, text: bool | None, encoding: str | None, errors: str | None) -> None:
    if bufsize != 0:
        raise ValueError("bufsize must be 0")
    if text:
        raise ValueError("text must be False")
    if encoding is not None:
        raise ValueError("encoding must be None")
    if errors is not None:
        raise ValueError("errors must be None")


async def _spawn(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.SubprocessProtocol],
    args: Any,
    shell: bool,
    stdin: Any,
    stdout: Any,
    stderr: Any,
    bufsize: int,
    kwargs: dict[str, Any],
) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
    """BaseEventLoop's protocol creation plus _UnixSelectorEventLoop._make_subprocess_transport,
    except that a failed start waits for the killed child's exit, not for `_wait()`: on 3.11+ that
    waits for every pipe to be connected and closed, which never happens when connecting one failed."""
    protocol = protocol_factory()
    waiter = loop.create_future()
    transport = _PidfdSubprocessTransport(
        loop, protocol, args, shell, stdin, stdout, stderr, bufsize, waiter=waiter, **kwargs
    )
    try:
        await waiter
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        transport.close()
        await transport._exited
        raise
    return transport, protocol


async def _subprocess_exec(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.SubprocessProtocol],
    program: Any,
    *args: Any,
    stdin: Any = subprocess.PIPE,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    universal_newlines: bool = False,
    shell: bool = False,
    bufsize: int = 0,
    encoding: str | None = None,
    errors: str | None = None,
    text: bool | None = None,
    **kwargs: Any,
) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
    if universal_newlines:
        raise ValueError("universal_newlines must be False")
    if shell:
        raise ValueError("shell must be False")
    _check_text_arguments(bufsize, text, encoding, errors)
    return await _spawn(loop, protocol_factory, (program, *args), False, stdin, stdout, stderr, bufsize, kwargs)


async def _subprocess_shell(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.SubprocessProtocol],
    cmd: Any,
    *,
    stdin: Any = subprocess.PIPE,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    universal_newlines: bool = False,
    shell: bool = True,
    bufsize: int = 0,
    encoding: str | None = None,
    errors: str | None = None,
    text: bool | None = None,
    **kwargs: Any,
) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
    if not isinstance(cmd, (bytes, str)):
        raise ValueError("cmd must be a string")
    if universal_newlines:
        raise ValueError("universal_newlines must be False")
    if not shell:
        raise ValueError("shell must be True")
    _check_text_arguments(bufsize, text, encoding, errors)
    return await _spawn(loop, protocol_factory, cmd, True, stdin, stdout, stderr, bufsize, kwargs)


_logged_reasons: set[str] = set()


def _route(
    spawn: Callable[..., Awaitable[tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]]],
) -> Callable[..., Awaitable[Any]]:
    async def wrapper(
        wrapped: Callable[..., Awaitable[Any]],
        instance: asyncio.AbstractEventLoop,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if not _routing:
            FALLBACK.set(None)
            return await wrapped(*args, **kwargs)
        reason = unsupported_reason(kwargs)
        FALLBACK.set(reason)
        if reason is None:
            return await spawn(instance, *args, **kwargs)
        if reason not in _logged_reasons:
            _logged_reasons.add(reason)
            _log.info(
                "stallwatch: %s=vfork: a uvloop spawn uses uvloop's own fork() because of %s, so at-fork "
                "handlers run in its child (logged once per reason).",
                SETTING,
                reason,
            )
        return await wrapped(*args, **kwargs)

    return wrapper


_ROUTE_EXEC, _ROUTE_SHELL = _route(_subprocess_exec), _route(_subprocess_shell)
_installed = False
_routing = False


def install() -> None:
    """Route uvloop's subprocess_exec/subprocess_shell through Popen from now on (idempotent)."""
    global _installed, _routing
    _routing = _installed = True
    uvloop_layers.add("route", _ROUTE_EXEC, _ROUTE_SHELL)  # puts the layer back if it was removed


def disable() -> None:
    """Spawn with uvloop's own fork from now on (``setup(uvloop_spawn="fork")`` after the import
    installed the routing); the wrappers stay, and pass every call through unchanged."""
    global _routing
    _routing = False


def installed() -> bool:
    """True while uvloop's spawns are routed through Popen: `install()` ran and `disable()` did not since."""
    return _installed and _routing
