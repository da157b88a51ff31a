"""The heartbeat file's layout and the watchdog's reading of it (`heartbeat` writes it).

The idle freeze watchdog reads the file every poll and loads nothing else of stallwatch's, so this
module imports only `os`, `struct` and `fcntl` (not `contextlib`, whose own imports are more than the
idle watchdog's others together), and takes paths as strings or `os.PathLike`.
"""

from __future__ import annotations

import fcntl
import os
import struct

TYPE_CHECKING = False  # `typing` stays out of the idle watchdog
if TYPE_CHECKING:
    from typing import Any

MAGIC = b"SWHB0002"
# magic, host pid, flags, interpreter ns, loop ns, spawn-start ns, loop kind, watchdog pid, spawn
# command, the spawn's trace id and span id, the main thread's current trace id and span id.
# Offsets are fixed so the watchdog can read fields one by one. The watchdog pid is the only field
# the watchdog writes, and the host never does after creating the file.
LAYOUT = struct.Struct("<8sIIqqqiI256s16s8s16s8s")
OFFSET_INTERP, OFFSET_LOOP, OFFSET_SPAWN = 16, 24, 32
OFFSET_LOOP_KIND, OFFSET_WATCHDOG = 40, 44
OFFSET_COMMAND, OFFSET_TRACE, OFFSET_SPAN, OFFSET_CURRENT = 48, 304, 320, 328
FLAG_LOOP_TRACKED = 1
LOOP_KINDS = {"none": 0, "asyncio": 1, "uvloop": 2}
BEAT_SECONDS = 0.1
# The heartbeat file's companions, its `.hb` replaced: the Sentry handover (and the copy that replaces
# it), and the host's stacks (`heartbeat.sentry_path`, `heartbeat.stacks_path`).
COMPANION_SUFFIXES = (".sentry", ".sentry-new", ".stacks")


def remove_files(path: str | os.PathLike[str]) -> None:
    """Remove a heartbeat file and its companions (`COMPANION_SUFFIXES`); those already gone are no error."""
    base = os.path.splitext(os.fspath(path))[0]
    for each in (os.fspath(path), *(base + suffix for suffix in COMPANION_SUFFIXES)):
        try:  # noqa: SIM105  # footprint: `contextlib` stays out of the idle watchdog
            os.unlink(each)
        except FileNotFoundError:
            pass


def in_use(path: str | os.PathLike[str]) -> bool:
    """Whether a process holds the lock of the heartbeat file at `path`: its host, or a child the
    host forked that has not exec'd. False once the host has exec'd another program (the descriptor
    is close-on-exec) or died. True when it cannot be told (no such file, no access)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by the close below
        return False
    except OSError:  # BlockingIOError: the host's exclusive lock
        return True
    finally:
        os.close(fd)


def mark_watched(path: str | os.PathLike[str]) -> None:
    """The watchdog's side: write its pid into the file at `path` (`HeartbeatArea.watched_by`).

    A 4-byte store at an offset only the watchdog writes, through the page cache the host's mapping
    shares. Never raises: a file that vanished is marked again once the host has made it again.
    """
    try:  # footprint: not `contextlib.suppress`, as in remove_files
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.pwrite(fd, os.getpid().to_bytes(4, "little"), OFFSET_WATCHDOG)
        finally:
            os.close(fd)
    except OSError:
        pass


def read(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The watchdog's side: one snapshot of the file (a torn value is re-read at the next poll), or
    None if unusable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, LAYOUT.size + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) != LAYOUT.size:
        return None
    fields = LAYOUT.unpack(data)
    if fields[0] != MAGIC:
        return None
    _, pid, flags, interp, loop, spawn, loop_kind, watchdog_pid, command, trace_id, span_id, *current = fields
    kinds = {v: k for k, v in LOOP_KINDS.items()}
    return {
        "pid": pid,
        "loop_tracked": bool(flags & FLAG_LOOP_TRACKED),
        "interpreter_ns": interp,
        "loop_ns": loop,
        "spawn_ns": spawn,
        "loop_kind": kinds.get(loop_kind, "none"),
        "watchdog_pid": watchdog_pid,
        "spawn_command": command.rstrip(b"\0").decode(errors="replace"),
        "trace_id": trace_id.hex(),
        "span_id": span_id.hex(),
        "current_trace_id": current[0].hex(),
        "current_span_id": current[1].hex(),
    }
