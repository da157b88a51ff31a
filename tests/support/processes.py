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


def descendants(pid: int) -> list[int]:
    """The pids of every living process below `pid` (children, their children, ...), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def session_members(session: int) -> list[int]:
    """The pids of every living process in session `session` (its leader's pid), orphans included: a
    process keeps its session when its parent dies and it is reparented."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[3]) == session and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found
