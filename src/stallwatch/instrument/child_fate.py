"""What became of a child process beyond its return code: did it exec, and did the host signal it.

A child killed by a signal right after its spawn is incident 000's signature only when it died before
exec, as a copy of the host; one that crashed in its own program, or that the host killed itself
(dstack SIGKILLs a foreground tunnel's `ssh` group), is not. This module tells them apart by facts
the kernel keeps, not by timing.

Exec (`stallwatch.subprocess.exec`, see `exec_seen`): `done` (the child ran its program), `not_done`
(it died before exec), `unknown` (something else reaped it first, or `/proc` was unreadable).

Signals the host sends from Python are recorded on the child they reach, with the time they were
sent, while it is not reaped: `os.kill`, `os.killpg`, `signal.pidfd_send_signal` (which carry
`Popen`'s methods, the standard loop's transport and the `STALLWATCH_UVLOOP_SPAWN=vfork` one) and
`asyncio.subprocess.Process.send_signal`/`terminate`/`kill` on uvloop. Not seen: uvloop's transport
methods (its `close()` included), signals from other C code or other processes; signal 0 is no signal.
"""

from __future__ import annotations

import asyncio.subprocess
import os
import signal
from asyncio import base_subprocess
from collections.abc import Callable, Sequence
from time import time_ns
from typing import Any

import wrapt

from .. import telemetry
from .._private import never_execed
from ..core.faults import FAULTS, signal_name
from ._lifecycle import ForkReset, unwrap

COMPONENT = "subprocess"
SETTING = "STALLWATCH_INSTRUMENT_SUBPROCESS"
DONE, NOT_DONE, UNKNOWN = "done", "not_done", "unknown"
MAX_SIGNALS = 8
"""Signals kept per child (a host that sends SIGWINCH on every resize would send many)."""

_PEEK = os.WEXITED | os.WNOHANG | os.WNOWAIT
_MAX_NEW_CHILDREN = 8  # the newest children of a thread looked at after a uvloop spawn
_PROCESS_METHODS = ("send_signal", "terminate", "kill")


class Fate:
    """One child's pid, exec verdict and the signals the host sent it: `(signal number, time_ns)`."""

    __slots__ = ("exec", "pid", "signals")

    def __init__(self, exec_: str, pid: int) -> None:
        self.exec = exec_
        self.pid = pid
        self.signals: list[tuple[int, int]] = []


# pid -> fate of each child from its spawn call's return to its reaping. No lock: every use is one dict
# operation (atomic under the GIL).
_by_pid: dict[int, Fate] = {}


def _fault() -> None:
    FAULTS.record(COMPONENT, SETTING)


# ---- exec ---------------------------------------------------------------------------------------


def exec_seen(pid: int, forked: bool = False) -> Fate:
    """Right after the spawn call that returned `pid`: did the child exec.

    Every spawn call returns once its child has exec'd or is dying (a close-on-exec pipe's end of
    file, or vfork/`posix_spawn` suspending the caller), but a child dying before exec is not a
    zombie yet, so it can still look alive. The kernel knows: `PF_FORKNOEXEC` is set in every new
    process and cleared at exec, shown in `/proc/PID/stat` until the child is reaped. Reading it is
    dearer than the rest of a spawn's instrumentation, so it is read only where a child can die
    before exec: after a real fork (host code ran in the child: at-fork handlers, `preexec_fn`), and
    for a vfork/`posix_spawn` child already dead when its spawn returned; one still running (seen
    with `WNOWAIT`, which leaves it for whoever reaps it) ran no host code and is taken as exec'd.

    `forked`: whether the spawn was a real fork.
    """
    try:
        dead = os.waitid(os.P_PID, pid, _PEEK)
    except OSError:  # reaped by someone else already
        return Fate(UNKNOWN, pid)
    return Fate(DONE if dead is None and not forked else _flags(pid), pid)


def new_children() -> dict[int, Fate]:
    """Right after a spawn whose pid is not known yet, on the thread that forked: the verdicts of
    that thread's children not watched yet (normally only the new one), from
    `/proc/thread-self/children`; empty without it (a kernel without CONFIG_PROC_CHILDREN).

    uvloop's pid is known only after its loop has run, which may have reaped the child, so the look
    happens right after the spawn's first step, where uvloop forks and waits.
    """
    try:
        with open("/proc/thread-self/children", "rb") as children:
            pids = [int(pid) for pid in children.read().split()]
    except (OSError, ValueError):
        return {}
    return {pid: Fate(_flags(pid), pid) for pid in pids[-_MAX_NEW_CHILDREN:] if pid not in _by_pid}


def _flags(pid: int) -> str:
    """The verdict from the kernel's flags of a child not yet reaped whose spawn call has returned."""
    never = never_execed(pid)
    return UNKNOWN if never is None else NOT_DONE if never else DONE


# ---- the registry the signal wrappers look children up in ----------------------------------------


def watch(fate: Fate) -> None:
    """From the spawn call's return: signals to `fate.pid` are recorded on `fate`."""
    _by_pid[fate.pid] = fate


def forget(fate: Fate) -> None:
    """The child was reaped: signals from now on are not its (the pid may be reused)."""
    if _by_pid.get(fate.pid) is fate:
        del _by_pid[fate.pid]


def _forget_the_parents_children() -> None:
    """In a fork child that lives on: the parent's children are not this process's to signal."""
    _by_pid.clear()


_FORK_RESET = ForkReset(_forget_the_parents_children)  # starts nothing: clears one map


# ---- signals ------------------------------------------------------------------------------------


def _in_group(pgid: int) -> list[Fate]:
    fates = []
    for pid, fate in list(_by_pid.items()):
        try:
            if os.getpgid(pid) == pgid:
                fates.append(fate)
        except OSError:
            continue
    return fates


def _kill_targets(pid: int) -> Sequence[Fate]:
    if pid > 0:
        fate = _by_pid.get(pid)
        return (fate,) if fate is not None else ()
    if pid == 0:
        return _in_group(os.getpgrp())
    if pid == -1:
        return list(_by_pid.values())
    return _in_group(-pid)


def _killpg_targets(pgid: int) -> Sequence[Fate]:
    return _in_group(pgid if pgid > 0 else os.getpgrp())


def _pidfd_targets(pidfd: int) -> Sequence[Fate]:
    """The child a pidfd refers to, from its `Pid:` line (-1 once the process was reaped; none for a
    descriptor that is no pidfd, which the call itself refuses)."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as info:
            lines = info.read().splitlines()
    except OSError:
        return ()
    for line in lines:
        if line.startswith(b"Pid:"):
            pid = int(line.split()[1])
            return _kill_targets(pid) if pid > 0 else ()
    return ()


def _note(fates: Sequence[Fate], signum: int) -> list[tuple[Fate, tuple[int, int]]]:
    sent = (signum, time_ns())
    noted = []
    for fate in fates:
        if len(fate.signals) < MAX_SIGNALS:
            fate.signals.append(sent)
            noted.append((fate, sent))
    return noted


def _unnote(noted: list[tuple[Fate, tuple[int, int]]]) -> None:
    for fate, sent in noted:
        if sent in fate.signals:
            fate.signals.remove(sent)


def _send_noted(
    wrapped: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    noted: list[tuple[Fate, tuple[int, int]]] | None,
) -> Any:
    """`wrapped(*args, **kwargs)`, its result or exception unchanged; the signal `noted` for it is
    taken back if the call raises (it was not sent)."""
    if not noted:
        return wrapped(*args, **kwargs)
    try:
        return wrapped(*args, **kwargs)
    except BaseException:
        _unnote(noted)
        raise


def _note_on(
    targets: Callable[[Any], Sequence[Fate]], target: Any, signum: int
) -> list[tuple[Fate, tuple[int, int]]] | None:
    """`signum` noted on each child `targets(target)` finds (None where it finds none); a failure is
    counted and notes nothing."""
    try:
        fates = targets(target)
        return _note(fates, signum) if fates else None
    except Exception:
        _fault()
        return None


def _sent(targets: Callable[[int], Sequence[Fate]]) -> Callable[..., Any]:
    """A wrapper for `os.kill`-like functions: `(target, signal, ...)`, positional only."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        noted = None
        if _by_pid and len(args) >= 2:
            target, signum = args[0], args[1]
            if type(target) is int and isinstance(signum, int) and signum > 0:
                noted = _note_on(targets, target, signum)
        return _send_noted(wrapped, args, kwargs, noted)

    return wrapper


def _process_targets(process: asyncio.subprocess.Process) -> Sequence[Fate]:
    """The child of `process` if its transport sends signals from C (uvloop's); none for the standard
    library's transports, which reach `os.kill` or `signal.pidfd_send_signal` and are noted there, only
    if the signal is really sent."""
    if isinstance(process._transport, base_subprocess.BaseSubprocessTransport):  # type: ignore[attr-defined]
        return ()
    return _kill_targets(process.pid)


def _process_signal(method: str) -> Callable[..., Any]:
    """A wrapper for `asyncio.subprocess.Process.<method>`, which records the signal where the process's
    transport sends it from C (`_process_targets`)."""
    fixed = {"terminate": signal.SIGTERM, "kill": signal.SIGKILL}.get(method)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        noted = None
        if _by_pid:
            signum = fixed if fixed is not None else (args[0] if args else kwargs.get("signal"))
            if isinstance(signum, int) and signum > 0:
                noted = _note_on(_process_targets, instance, signum)
        return _send_noted(wrapped, args, kwargs, noted)

    return wrapper


def install() -> None:
    _FORK_RESET.register()
    wrapt.wrap_function_wrapper(os, "kill", _sent(_kill_targets))
    wrapt.wrap_function_wrapper(os, "killpg", _sent(_killpg_targets))
    if hasattr(signal, "pidfd_send_signal"):
        wrapt.wrap_function_wrapper(signal, "pidfd_send_signal", _sent(_pidfd_targets))
    for method in _PROCESS_METHODS:
        wrapt.wrap_function_wrapper(asyncio.subprocess.Process, method, _process_signal(method))


def uninstall() -> None:
    unwrap(os, "kill")
    unwrap(os, "killpg")
    if hasattr(signal, "pidfd_send_signal"):
        unwrap(signal, "pidfd_send_signal")
    for method in _PROCESS_METHODS:
        unwrap(asyncio.subprocess.Process, method)
    _by_pid.clear()


# ---- what the span says -------------------------------------------------------------------------


def host_signals(fate: Fate, end_ns: int) -> list[tuple[int, int]]:
    """The signals the host sent the child while it lived (the span ends at its reaping)."""
    return [sent for sent in fate.signals if sent[1] <= end_ns]


def annotate(fate: Fate, attributes: dict[str, Any], end_ns: int) -> None:
    """The span's exec verdict and, when the host signalled the child, that fact."""
    attributes[telemetry.SUBPROCESS_EXEC.name] = fate.exec
    if fate.signals and host_signals(fate, end_ns):  # most children get no signal from the host
        attributes[telemetry.SIGNALLED_BY_HOST.name] = True


def add_events(span: Any, fate: Fate | None, start_ns: int, end_ns: int, returncode: int | None,
               lived: float, early_seconds: float) -> None:  # fmt: skip
    """One `stallwatch.subprocess.host_signal` event per signal the host sent, and
    `stallwatch.subprocess.early_signal` when a signal the host did not send killed a child that did
    not exec, or one that died within `early_seconds` while its exec is unknown."""
    sent = host_signals(fate, end_ns) if fate is not None else []
    for signum, at_ns in sent:
        span.add_event(
            "stallwatch.subprocess.host_signal",
            {"signal": signal_name(signum), "seconds": max(0, at_ns - start_ns) / 1e9},
            at_ns,
        )
    if returncode is None or returncode >= 0 or sent:
        return
    exec_ = fate.exec if fate is not None else UNKNOWN
    if exec_ == NOT_DONE or (exec_ == UNKNOWN and lived < early_seconds):
        event = {
            telemetry.EXIT_SIGNAL.name: signal_name(-returncode),
            "seconds": lived,
            telemetry.SUBPROCESS_EXEC.name: exec_,
        }
        span.add_event("stallwatch.subprocess.early_signal", event, end_ns)


def killed_by(returncode: int, fate: Fate | None, end_ns: int) -> str:
    """The span's status message for a child a signal killed."""
    number = -returncode
    text = f"killed by {signal_name(number)}"
    if fate is None:
        return text
    if fate.exec == NOT_DONE:
        text += " before exec"
    if any(signum == number for signum, _ in host_signals(fate, end_ns)):
        text += ", which the host sent"
    return text
