"""What `subprocess.Popen`'s arguments say about a spawn: its program and argv, and how it forks.

Read from the arguments as given, positional or keyword, without calling anything of the host's.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any

# Popen.__init__(args, bufsize, executable, stdin, stdout, stderr, preexec_fn, close_fds, shell, cwd, env, ...)
POPEN_POSITIONS = {"args": 0, "executable": 2, "preexec_fn": 6, "shell": 8, "env": 10}
_PLAIN_ARGV = frozenset({list, tuple, str, bytes})  # exact types that need no materializing (no ABC checks)


def _popen_arg(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    position = POPEN_POSITIONS[name]
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


def popen_command(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[object, list[object]]:
    """The program and argv a Popen with these arguments runs (for a shell, the command line)."""
    if len(args) == 1 and not kwargs.get("shell") and kwargs.get("executable") is None:
        command = args[0]
        if type(command) is list:  # the usual call, `run([program, ...], ...)`: read as given
            return (command[0] if command else "?"), command
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


def materialized(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
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
