"""Processes seen from /proc."""

from __future__ import annotations

from pathlib import Path


def is_gone(pid: int) -> bool:
    """Exited, or a zombie: an orphan is reparented to a PID 1 that may never reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def command_line(pid: int) -> str:
    """The process's arguments joined by spaces, or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""
